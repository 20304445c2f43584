"""Engine vs llama.cpp, and the whole stack vs the engine, measured in one run on one machine.

Ours: the real ``TorchBackend`` on the default model (``--dtypes``, default the worker's ``auto``
= the Q4_1 blocks on sluice's CPU kernels, and fp32). llama.cpp: llama-cpp-python's low-level
batched decode API on the same GGUF, run in a subprocess with a throwaway venv's python
(``--llama-python``) so the project venv needs no llama_cpp:
``n_threads=n_threads_batch=--threads``, n_batch=n_ubatch=512, one seq_id per sequence,
non-unified KV, flash-attn off (llama.cpp built from source with ``GGML_NATIVE=ON``). Both
get the same prompt token ids (rendered with sluice's renderer, ~200 tokens, ragged variants
for batches), greedy, ``--tokens`` generated with EOS ignored.

Metrics: prefill tok/s of one prompt; decode tok/s for 1 stream and aggregate for 4/8/16 streams
= tokens produced after every stream of the batch has started, over that span (ours prefills
one sequence per step between decode steps, so earlier streams' tokens are not counted). Each
repeat records the 1-minute load average and the CPU that *other* processes used (from
/proc/stat minus our own processes). A repeat where others took more than ``--max-others`` cores
is retried (up to twice ``--repeats`` tries per measurement); medians use the clean repeats, or
all of them, flagged, when none was clean.

The whole stack: a private redis-server, ``sluice api`` and ``sluice worker`` (threads
``--stack-threads``) on the same cores; one streaming ``/v1/chat/completions`` client, decode
tok/s seen by it vs the engine alone (same dtype, measured in this run).

    .venv/bin/python -m ops.bench.vs_llamacpp --llama-python /tmp/llamavenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# A sibling file, not a package import: the llama.cpp child runs this script with another
# venv's python, where only the script's own folder is on sys.path.
from ops.bench.machine_load import attempts, decode_rate, emit, is_clean, load_probe

ROOT = Path(__file__).resolve().parents[2]

TEXT = (
    "Describe in detail how a small river town changes over one year, covering the weather, "
    "the people who work on the water, the markets, the festivals, the schools and the old "
    "bridge that everyone crosses each morning. "
)


# --- llama.cpp (child process, throwaway venv) ------------------------------------------------


def llama_child(spec: dict[str, Any]) -> None:
    """Run every llama.cpp measurement described by ``spec``; print JSON lines."""
    import ctypes

    import llama_cpp as L  # the throwaway venv only (mypy config ignores missing imports)
    import numpy as np

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(spec["gguf"].encode(), mparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    prompts: list[list[int]] = spec["prompts"]
    threads, tokens = spec["threads"], spec["tokens"]

    def context(n_seq: int) -> Any:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = 512 * n_seq, 512, 512, n_seq
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED: "auto" is slower on this CPU
        p.kv_unified = False
        p.no_perf = True
        return L.llama_init_from_model(model, p)

    batch = L.llama_batch_init(512, 0, 16)

    def decode(ctx: Any, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, pos, seq, want_logits) items."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(ctx: Any, i: int) -> int:
        ptr = L.llama_get_logits_ith(ctx, i)
        arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,))
        return int(arr.argmax())

    def prefill(ctx: Any, seq: int) -> int:
        ids = prompts[seq]
        decode(ctx, [(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)])
        return argmax(ctx, len(ids) - 1)

    mo: float = spec["max_others"]
    done: list[dict[str, Any]] = []
    for rep in attempts(spec["repeats"], mo, done):
        ctx = context(1)
        row: dict[str, Any] = {"engine": "llama.cpp", "metric": "prefill", "repeat": rep}
        with load_probe([], row):
            t0 = time.perf_counter()
            prefill(ctx, 0)
            row["seconds"] = time.perf_counter() - t0
        row["prompt_tokens"] = len(prompts[0])
        row["value"] = len(prompts[0]) / row["seconds"]
        emit(row)
        done.append(row)
        L.llama_free(ctx)
    for b in spec["batches"]:
        ctx = context(b)
        mem = L.llama_get_memory(ctx)
        done = []
        for rep in attempts(spec["repeats"], mo, done):
            L.llama_memory_clear(mem, True)
            row = {"engine": "llama.cpp", "metric": "decode", "batch": b, "repeat": rep}
            with load_probe([], row):
                # Like llama-server: each sequence prefilled into its own slot, then one forward
                # per step for all of them.
                last = [prefill(ctx, s) for s in range(b)]
                out = [[t] for t in last]
                t0 = time.perf_counter()
                for step in range(tokens - 1):
                    decode(ctx, [(last[s], len(prompts[s]) + step, s, True) for s in range(b)])
                    last = [argmax(ctx, s) for s in range(b)]
                    for s in range(b):
                        out[s].append(last[s])
                span = time.perf_counter() - t0
            row.update(value=b * (tokens - 1) / span, seconds=span, first16=out[0][:16])
            emit(row)
            done.append(row)
        L.llama_free(ctx)
    L.llama_batch_free(batch)
    L.llama_model_free(model)


def run_llama(
    args: argparse.Namespace, gguf: str, prompts: list[list[int]]
) -> list[dict[str, Any]]:
    """Run the llama.cpp side in a subprocess with ``--llama-python``; return its rows."""
    spec = {
        "gguf": gguf,
        "prompts": prompts,
        "threads": args.threads,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "batches": args.batches,
        "max_others": args.max_others,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run(
        [args.llama_python, "-m", "ops.bench.vs_llamacpp", "--llama-child", f.name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    os.unlink(f.name)
    if proc.returncode != 0:
        sys.exit(f"llama.cpp child failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        emit(row)
    return rows


# --- ours (this process) ----------------------------------------------------------------------


MODEL = ["smollm2"]  # --model: the GGUF both engines load (set once by main)


def render_prompts(n: int) -> tuple[str, list[list[int]]]:
    """The GGUF path and ``n`` ragged ~200-token prompts rendered by sluice's renderer."""
    from services.worker.loaders import default_model_path, load_model
    from shared.prompt import PromptRenderer

    loaded = load_model(MODEL[0], name="smollm2", device="cpu", dtype="float32")
    renderer = PromptRenderer(loaded.card, loaded.tokenizer)
    prompts = [list(renderer.render(job(i, 1, None)).token_ids) for i in range(n)]
    return str(default_model_path() if MODEL[0] == "smollm2" else MODEL[0]), prompts


def prompt_text(i: int) -> str:
    """User message ``i``: ~200 tokens once rendered; the tail varies so batches are ragged."""
    return f"Story {i}: " + TEXT * 4 + "Thank you! " * (i % 5)


def job(i: int, tokens: int, ids: list[int] | None) -> Any:
    """A greedy, EOS-ignoring chat request; ``i`` varies the text so prompts are ragged.

    With ``ids`` (the prompt rendered by ``render_prompts``) it is the tokenized job a worker runs.
    """
    from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart

    request = GenerateRequest(
        request_id=f"vs-{i}-{time.monotonic_ns()}",
        model="smollm2",
        messages=[Message(role="user", content=[TextPart(text=prompt_text(i))])],
        sampling=SamplingParams(temperature=0.0),
        max_tokens=tokens,
        ignore_eos=True,
    )
    return request if ids is None else Job.of(request, prompt_token_ids=ids, prompt_text="")


async def _timed(backend: Any, j: Any, ids: list[int] | None = None) -> list[tuple[float, int]]:
    """Run one job; per event batch (time, tokens); the first record is the Start event.

    Generated token ids are appended to ``ids`` when given.
    """
    from shared.events import Start

    out: list[tuple[float, int]] = []
    async for events in backend.generate(j, [], 1):
        now = time.perf_counter()
        got = [t for e in events for t in getattr(e, "token_ids", ())]
        if ids is not None:
            ids.extend(got)
        n = len(got)
        if not out and any(isinstance(e, Start) for e in events):
            out.append((now, 0))
        if n:
            out.append((now, n))
    return out


def run_ours(
    args: argparse.Namespace, dtype: str, threads: int, prompts: list[list[int]], batches: list[int]
) -> list[dict[str, Any]]:
    """Prefill and decode measurements of our engine with ``dtype`` and ``threads``."""
    import asyncio

    import torch

    from services.worker.torch_backend import TorchBackend
    from shared.config import Settings

    torch.set_num_threads(threads)
    backend = TorchBackend.load(
        Settings(threads=threads, max_batch=max(batches), dtype=dtype), MODEL[0], "smollm2"
    )
    rows: list[dict[str, Any]] = []
    tag = {"engine": "ours", "dtype": dtype, "threads": threads}

    def fresh() -> None:
        # Forget cached prefixes so each measurement prefills its whole prompt.
        backend.scheduler.clear_prefix_cache()

    async def go() -> None:
        await backend.start()
        try:
            await _timed(backend, job(0, 4, prompts[0]))  # warm-up
            done: list[dict[str, Any]] = []
            for rep in attempts(args.repeats if args.prefill else 0, args.max_others, done):
                fresh()
                row: dict[str, Any] = {**tag, "metric": "prefill", "repeat": rep}
                with load_probe([], row):
                    t0 = time.perf_counter()
                    rec = await _timed(backend, job(0, 1, prompts[0]))
                row.update(seconds=rec[0][0] - t0, prompt_tokens=len(prompts[0]))
                row["value"] = len(prompts[0]) / row["seconds"]
                emit(row)
                done.append(row)
            rows.extend(done)
            for b in batches:
                done = []
                for rep in attempts(args.repeats, args.max_others, done):
                    fresh()
                    row = {**tag, "metric": "decode", "batch": b, "repeat": rep}
                    first: list[int] = []
                    with load_probe([], row):
                        runs = await asyncio.gather(
                            *(
                                _timed(
                                    backend,
                                    job(s, args.tokens, prompts[s]),
                                    first if s == 0 else None,
                                )
                                for s in range(b)
                            )
                        )
                    row["value"], row["tokens_counted"], row["seconds"] = decode_rate(runs)
                    row["first16"] = first[:16]
                    emit(row)
                    done.append(row)
                rows.extend(done)
        finally:
            await backend.stop()

    asyncio.run(go())
    return rows


# --- summary ----------------------------------------------------------------------------------


def median(rows: list[dict[str, Any]], max_others: float, **match: Any) -> tuple[float, str]:
    """Median value of the matching rows (clean repeats only when any are clean) and a note."""
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if not hits:
        return float("nan"), "none"
    clean = [r for r in hits if is_clean(r, max_others)]
    use = clean or hits
    note = f"{len(clean)}/{len(hits)} clean" + ("" if clean else " (FLAGGED: noisy)")
    return statistics.median(r["value"] for r in use), note


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Print a Markdown table of medians and ratios against issue 3's targets."""
    mo = args.max_others
    targets = {1: 0.75, 4: 1.0, 8: 1.0, 16: 1.5}
    print("\n| metric | llama.cpp | " + " | ".join(f"ours {d}" for d in args.dtypes), end="")
    print(" | " + " | ".join(f"ratio {d}" for d in args.dtypes) + " | target |")
    print("|---" * (3 + 2 * len(args.dtypes)) + "|")
    specs: list[tuple[str, dict[str, Any], float]] = [("prefill tok/s", {"metric": "prefill"}, 2.0)]
    specs += [
        (f"decode B={b} tok/s", {"metric": "decode", "batch": b}, targets.get(b, 1.0))
        for b in args.batches
    ]
    for name, m, target in specs:
        ref, rnote = median(rows, mo, engine="llama.cpp", **m)
        vals = [
            median(rows, mo, engine="ours", dtype=d, threads=args.threads, **m) for d in args.dtypes
        ]
        cells = [f"{v:.1f} ({n})" for v, n in vals]
        ratios = [f"{v / ref:.2f}x {'met' if v / ref >= target else 'MISSED'}" for v, _ in vals]
        print(f"| {name} | {ref:.1f} ({rnote}) | " + " | ".join(cells + ratios), end="")
        print(f" | {target}x |")
    for t in args.stack_threads:
        stack, snote = median(rows, mo, engine="stack", threads=t)
        for et in sorted({t, args.threads}):
            alone, anote = median(
                rows,
                mo,
                engine="ours",
                dtype=args.stack_dtype,
                threads=et,
                metric="decode",
                batch=1,
            )
            ok = "met" if stack / alone >= 0.9 else "MISSED"
            print(
                f"\nwhole stack, worker {t} thread(s): {stack:.1f} tok/s ({snote}) vs engine "
                f"alone {args.stack_dtype} {et} thread(s) {alone:.1f} ({anote}): "
                f"{stack / alone:.2f}x (target 0.9x, {ok})"
            )


def main() -> None:
    """Parse arguments, run every measurement, print rows and the summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-python", default="/tmp/llamavenv/bin/python")
    p.add_argument("--llama-child", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--dtypes", nargs="+", default=["auto", "float32"])
    p.add_argument("--stack-threads", type=int, nargs="*", default=[1, 2])
    p.add_argument("--stack-dtype", default="auto")
    p.add_argument("--max-others", type=float, default=0.2, help="flag repeats above (cores)")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--model", default="smollm2", help="any GGUF of the default architecture")
    args = p.parse_args()
    MODEL[0] = args.model
    if args.llama_child:
        llama_child(json.loads(Path(args.llama_child).read_text()))
        return
    args.prefill = True
    emit({"machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "args": vars(args)}})
    gguf, prompts = render_prompts(max(args.batches))
    emit({"prompt_tokens": [len(x) for x in prompts]})
    rows: list[dict[str, Any]] = []
    if not args.skip_llama:
        rows += run_llama(args, gguf, prompts)
    for d in args.dtypes:
        rows += run_ours(args, d, args.threads, prompts, args.batches)
    args.prefill = False
    from ops.bench.stack_run import run_stack  # httpx and the project: the parent process only

    for t in args.stack_threads:
        if t != args.threads:
            rows += run_ours(args, args.stack_dtype, t, prompts, [1])
        rows += run_stack(args, t, prompt_text(0))
    summarize(args, rows)


if __name__ == "__main__":
    main()
