"""Speculative decoding benchmark: tokens/s with and without prompt-lookup speculation.

Runs the real ``TorchBackend`` on the default model, greedy with EOS honoured up to
``--tokens``, three workloads: a code edit (a ~2,500-character Python file to be written out
whole with one rename), a quote (a passage of the prompt to be repeated) and a fresh story. At
each concurrency the same jobs run with speculation off and on, alternating, in one process on
one loaded model (the speculator is detached for the "off" runs), so both see the same machine.
Greedy output is the same either way; the runs check that too. With ``--llama-server PATH``,
llama-server then runs the same workloads on the same GGUF with no speculation and with its
n-gram modes (``speculative_llama.py``), and our "on" rate is set against its best. Prints one
JSON object per measurement:

    .venv/bin/python -m ops.bench.speculative --threads 2 --tokens 256 --concurrency 1 4
    .venv/bin/python -m ops.bench.speculative --llama-server build/bin/llama-server
    .venv/bin/python -m ops.bench.speculative --dtype float32   # torch's model, not the kernels
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ops.bench.machine_load import emit, load_probe
from ops.bench.speculative_llama import llama_rows
from services.worker.loaders import default_model_path
from services.worker.speculation import Speculator
from services.worker.torch_backend import TorchBackend
from shared.config import Settings
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart
from shared.prompt import PromptRenderer

STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# The workloads' texts, frozen and read to the byte: the code edit's file is the head of
# shared/codec.py and the quote's passage a part of services/worker/sequence.py, as they stood
# when the answers were checked with ``from_prompt``. The default model's greedy answer turns on
# small things: the code edit used to be the head of the live sequence.py, and once that file
# changed the model answered with a description of it repeating one sentence (``from_prompt``
# 0.0), so the benchmark measured a repetition; the same codec.py head with its trailing blank
# line stripped is copied by one stream of four instead of all four (0.82-0.87 of the answers'
# 4-grams are in the prompt: the rest is the rename and what the model drops or adds).
WORKLOADS = Path(__file__).resolve().parent / "workloads"


def prompts() -> dict[str, str]:
    code = (WORKLOADS / "code_edit.py.txt").read_text()
    passage = (WORKLOADS / "quote.txt").read_text()
    return {
        "code_edit": "Rewrite this Python file, renaming `tokens` to `token_ids` everywhere. "
        "Output the whole file and nothing else.\n\n```python\n" + code + "\n```",
        "quote": "Here is a passage:\n\n" + passage + "\n\nQuote the passage above exactly, "
        "word for word.",
        "story": STORY,
    }


def job(b: TorchBackend, text: str, i: int, tokens: int) -> Job:
    req = GenerateRequest(
        request_id=f"spec-{i}-{time.monotonic_ns()}",
        model="m",
        messages=[Message(role="user", content=[TextPart(text=text)])],
        sampling=SamplingParams(temperature=0.0),
        max_tokens=tokens,
    )
    rendered = PromptRenderer(b.card, b.loaded.tokenizer).render(req)
    return Job.of(req, prompt_token_ids=list(rendered.token_ids), prompt_text=rendered.text)


def client_jobs(
    b: TorchBackend, text: str, clients: int, rounds: int, tokens: int
) -> tuple[list[list[Job]], list[list[Job]]]:
    """Each of ``clients`` clients' ``rounds`` jobs, back to back, on distinct prompts (a number
    in front, so the streams share no prefix), and one-token jobs that read every prompt once:
    run first, they leave each measured run finding the prompts cached alike (the first run
    would otherwise be the only one to read them)."""
    texts = [[f"({i + 1}.{r}) {text}" for r in range(rounds)] for i in range(clients)]
    jobs = [[job(b, t, i, tokens) for t in ts] for i, ts in enumerate(texts)]
    return jobs, [[job(b, t, 99, 1)] for ts in texts for t in ts]


def from_prompt(clients: list[list[Job]], outputs: list[list[int]], n: int = 4) -> float:
    """The share of the answers' ``n``-grams of token ids that occur in their own prompts: near
    1 for a copy of the prompt's text (the code edit, the quote), low for fresh text."""
    jobs = [j for c in clients for j in c]
    found = total = 0
    for j, ids in zip(jobs, outputs, strict=True):
        p = list(j.prompt_token_ids)
        seen = {tuple(p[i : i + n]) for i in range(len(p) - n + 1)}
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        found += sum(g in seen for g in grams)
        total += len(grams)
    return round(found / max(total, 1), 3)


async def run(b: TorchBackend, clients: list[list[Job]]) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of ``clients``, each sending its jobs one after another: the tokens that
    arrived after every client had its first one, over the span from then to the last end; and
    each job's ids. (Counting every token over that span overstated a run whose prompts were
    read one after another: the first streams decoded while the last still waited.)"""

    async def one(j: Job) -> list[tuple[float, int]]:
        arrivals, ids = list[tuple[float, int]](), list[int]()
        async for batch in b.generate(j, [], 1):
            got = [t for e in batch for t in getattr(e, "token_ids", ())]
            if got:
                arrivals.append((time.perf_counter(), len(got)))
                ids.extend(got)
        outputs[j.request_id] = ids
        return arrivals

    async def client(jobs: list[Job]) -> list[tuple[float, int]]:
        return [a for j in jobs for a in await one(j)]

    outputs: dict[str, list[int]] = {}
    runs = await asyncio.gather(*(client(c) for c in clients))
    start = max(r[0][0] for r in runs)
    end = max(r[-1][0] for r in runs)
    tokens = sum(n for r in runs for t, n in r if t > start)
    rate = tokens / (end - start) if end > start else 0.0  # (one-token jobs: no decode span)
    return rate, [outputs[j.request_id] for c in clients for j in c]


async def bench(args: argparse.Namespace) -> dict[tuple[str, int], float]:
    """Measure every workload at every concurrency; returns the "on" rate of each."""
    best: dict[tuple[str, int], float] = {}
    b = TorchBackend.load(
        Settings(
            threads=args.threads,
            max_batch=max(args.concurrency),
            speculative=True,
            speculative_tokens=args.k,
            dtype=args.dtype,
            cpu_kernels=not args.torch,
        ),
        args.model,
        None,
    )
    spec = b.scheduler.speculator
    assert isinstance(spec, Speculator)
    emit({"model": {"spec": args.model, "class": type(b.scheduler.model).__name__}})
    await b.start()
    try:
        await run(b, [[job(b, STORY, 0, 4)]])  # warm-up
        for name, text in prompts().items():
            if name not in args.workloads:
                continue
            for c in args.concurrency:
                jobs, reads = client_jobs(b, text, c, args.rounds, args.tokens)
                await run(b, reads)
                rates: dict[str, list[float]] = {"off": [], "on": []}
                outputs: dict[str, list[list[int]]] = {}
                probes: list[dict[str, Any]] = []  # each run's load (machine_load.load_probe)
                before = (spec.stats.drafts, spec.stats.draft_tokens, spec.stats.accepted_tokens)
                for rep in range(args.repeats):
                    # off first, then on first: the second run of a pair measured a few percent
                    # slower whichever mode it was, which a fixed order charges to one mode
                    for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                        b.scheduler.speculator = spec if mode == "on" else None
                        probes.append({})
                        with load_probe([], probes[-1]):
                            rate, ids = await run(b, jobs)
                        rates[mode].append(rate)
                        outputs[mode] = ids
                b.scheduler.speculator = spec
                drafts, drafted, accepted = (
                    now - was
                    for now, was in zip(
                        (spec.stats.drafts, spec.stats.draft_tokens, spec.stats.accepted_tokens),
                        before,
                        strict=True,
                    )
                )
                off, on = max(rates["off"]), max(rates["on"])
                best[name, c] = on
                emit(
                    {
                        "workload": name,
                        "concurrency": c,
                        "rounds": args.rounds,
                        "tokens": [len(t) for t in outputs["on"]],
                        "off_tok_s": round(off, 1),
                        "on_tok_s": round(on, 1),
                        "speedup": round(on / off, 2),
                        # each mode's runs in order (pairs alternate which goes first)
                        "off_runs": [round(r, 1) for r in rates["off"]],
                        "on_runs": [round(r, 1) for r in rates["on"]],
                        # each repeat's pair ran back to back: a burst spoils one pair
                        "median_pair_speedup": round(
                            statistics.median(
                                n / f for f, n in zip(rates["off"], rates["on"], strict=True)
                            ),
                            2,
                        ),
                        "same_output": outputs["on"] == outputs["off"],
                        # is the answer the copy the workload asks for? (a weak model's greedy
                        # text may not be: then a code edit's rows measure something else)
                        "from_prompt": from_prompt(jobs, outputs["on"]),
                        "drafted": drafted,
                        "accepted": accepted,
                        # vLLM's mean acceptance length: tokens per verifying step
                        "accepted_per_step": round(1 + accepted / max(drafts, 1), 2),
                        "others_cores_max": max(p["others_cores"] for p in probes),
                        "loadavg_1m": [
                            min(p["loadavg_1m"][0] for p in probes),
                            max(p["loadavg_1m"][1] for p in probes),
                        ],
                    }
                )
    finally:
        await b.stop()
    return best


def against_llama(args: argparse.Namespace, ours: dict[tuple[str, int], float]) -> None:
    """llama-server on the same GGUF and workloads, each of its modes, then our "on" rate
    against its best n-gram mode and against it with no speculation."""
    gguf = default_model_path() if args.model == "smollm2" else Path(args.model)
    workloads = {k: v for k, v in prompts().items() if k in args.workloads}
    probe: dict[str, Any] = {}
    with load_probe([], probe):
        rows = llama_rows(
            args.llama_server,
            gguf,
            workloads,
            args.concurrency,
            threads=args.threads,
            tokens=args.tokens,
            repeats=args.repeats,
        )
    for row in rows:
        emit(row)
    emit({"llama_load": probe})
    for (name, c), on in ours.items():
        theirs = {
            r["mode"]: r["tok_s"] for r in rows if (r["workload"], r["concurrency"]) == (name, c)
        }
        mode = max((m for m in theirs if m != "none"), key=lambda m: theirs[m])
        emit(
            {
                "workload": name,
                "concurrency": c,
                "sluice_on_tok_s": round(on, 1),
                "llama_best_ngram": mode,
                "vs_llama_best_ngram": round(on / theirs[mode], 2),
                "vs_llama_none": round(on / theirs["none"], 2),
            }
        )


def main() -> None:
    """Parse arguments and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--dtype", default="auto", help="SLUICE_DTYPE (float32: torch's model)")
    parser.add_argument("--torch", action="store_true", help="4-bit weights on torch, not ours")
    parser.add_argument("--repeats", type=int, default=2, help="best of, per mode")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="requests each stream sends back to back (1: a closed batch of C, whose last "
        "stream may decode alone at the end; more: C clients kept busy, as a server's are)",
    )
    parser.add_argument(
        "--workloads", nargs="+", default=["code_edit", "quote", "story"], help="which to run"
    )
    parser.add_argument(
        "--llama-server", help="also measure this llama-server binary (speculative_llama.py)"
    )
    args = parser.parse_args()
    if args.rounds > 1 and args.llama_server:
        parser.error("--rounds applies to sluice's runs only: measure llama-server at 1")
    torch.set_num_threads(args.threads)
    emit({"machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "k": args.k}})
    ours = asyncio.run(bench(args))
    if args.llama_server:
        against_llama(args, ours)


if __name__ == "__main__":
    main()
