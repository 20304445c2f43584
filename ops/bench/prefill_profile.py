"""Where a prefill's time goes on the CPU kernels: per stage, per GGUF file, per kernel build.

Times the model's own prefill (``forward``: B = 1, ``--tokens`` tokens, one ``sl_forward``
call), then runs the same stages one entry point at a time with a clock around each: the
quantizing stages (RMSNorm + quantize, quantize, SwiGLU + quantize), each GEMM (QKV, O,
gate|up, down, the head on the last row) and attention (``sl_attention``). ``--clock thread
--threads 1`` times CPU time instead of wall time, which a busy neighbour disturbs less. Sums
over the layers, medians over ``--repeats``; JSON lines out, with GFLOP/s per GEMM.
``--baseline DIR`` also builds the kernel sources in DIR (e.g. another checkout's
``services/worker/kernels``; same ABI) and times them on the same packed weights, alternating
with this checkout's build inside each repeat, so the before/after ratio is measured in one run.

    .venv/bin/python -m ops.bench.prefill_profile /tmp/q4_0.gguf /tmp/q8_0.gguf \
        --baseline /work/main/services/worker/kernels
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from services.worker import kernels
from services.worker.kernels import FLAGS, Activations, Kernels
from services.worker.kv_cache import PagedKVCache, SeqRows, build_batch
from services.worker.loaders import load_model
from services.worker.models.kernel_llama import QuantizedLlama

CPU = torch.device("cpu")
BLOCK = 16  # the scheduler's default block size


def build_from(directory: Path) -> Kernels:
    """The kernels compiled from the C files in ``directory`` with this checkout's flags."""
    out = Path(tempfile.mkdtemp()) / "baseline.so"
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"
    sources = sorted(str(p) for p in directory.glob("*.c"))
    subprocess.run([cc, *FLAGS, "-o", str(out), *sources, "-lm"], check=True)
    return Kernels(out)


CLOCK = [time.perf_counter]  # --clock thread: this thread's CPU time (1 thread on a busy host)


def profile(
    model: QuantizedLlama, k: Kernels, tokens: int, context: int = 0, gap: int = 0
) -> dict[str, float]:
    """Seconds per stage (summed over layers) of one prefill of ``tokens`` random ids after
    ``context`` cached ones (an agent's next turn), stage by stage through the exported entry
    points, and ``forward``: the model's own single call. ``gap``: blocks of the pool between
    two of the sequence's, as streams decoding side by side leave them (0: one contiguous run)."""
    cfg = model.config
    ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(0))
    blocks = -(-(context + tokens) // BLOCK)
    cache = PagedKVCache(
        layers=cfg.num_layers,
        num_blocks=blocks * (gap + 1),
        block_size=BLOCK,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=model.kv_dtype,
        device=CPU,
    )
    table = cache.extend([], blocks * (gap + 1))[:: gap + 1]
    if context:  # the cached prefix: real keys and values, computed once, untimed
        prefix = torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(1))
        model(prefix, build_batch([SeqRows(0, table, 0, context)], BLOCK, CPU), cache)
    batch = build_batch([SeqRows(0, table, context, tokens)], BLOCK, CPU)
    spent: dict[str, float] = defaultdict(float)
    model.kernels = k  # the packed weights do not depend on the build
    began = CLOCK[0]()
    model(ids, batch, cache)
    spent["forward"] = CLOCK[0]() - began
    clock = [CLOCK[0]()]

    def tick(stage: str) -> None:
        now = CLOCK[0]()
        spent[stage] += now - clock[0]
        clock[0] = now

    rows, eps, threads = tokens, cfg.rms_norm_eps, k.threads()
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    began = CLOCK[0]()
    x = model.embed(ids)
    act = Activations(rows, model.act_width)
    qkv = torch.empty(rows, model.blocks[0].qkv.out_features)
    attended = torch.empty(rows, H * hd)
    span = context + tokens
    gate_up = torch.empty(rows, 2 * cfg.intermediate_size)
    pos, seq = batch.positions.contiguous(), batch.seq_index.contiguous()
    tables = batch.tables.contiguous()
    rope = model.model.rope_cos.data_ptr(), model.model.rope_sin.data_ptr()
    tick("embed")
    for i, blk in enumerate(model.blocks):
        k.rmsnorm_quantize(x, blk.input_norm, eps, act)
        tick("quantize")
        blk.qkv(k, act, qkv)
        tick("gemm_qkv")
        norms = [0 if t is None else t.data_ptr() for t in (blk.q_norm, blk.k_norm)]
        k.lib.sl_attention(
            tokens, H, KV, hd, qkv.data_ptr(), *rope, pos.data_ptr(), seq.data_ptr(),
            tables.data_ptr(), tables.shape[1], BLOCK, cache.num_blocks, cache.k[i].data_ptr(),
            cache.v[i].data_ptr(), *norms, eps, attended.data_ptr(), span, threads,
        )  # fmt: skip
        tick("attention")
        k.quantize(attended, act)
        tick("quantize")
        blk.o_proj(k, act, x, accumulate=True)
        tick("gemm_o")
        k.rmsnorm_quantize(x, blk.post_norm, eps, act)
        tick("quantize")
        blk.gate_up(k, act, gate_up)
        tick("gemm_gate_up")
        k.swiglu_quantize(gate_up, act)
        tick("quantize")
        blk.down(k, act, x, accumulate=True)
        tick("gemm_down")
    head_in = Activations(1, cfg.hidden_size)
    k.rmsnorm_quantize(x[-1:].contiguous(), model.final_norm, eps, head_in)
    logits = torch.empty(1, model.head.out_features)
    model.head(k, head_in, logits)
    tick("head")
    spent["total"] = CLOCK[0]() - began
    return dict(spent)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--tokens", type=int, default=190)
    p.add_argument("--context", type=int, default=0, help="tokens already cached before them")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline", type=Path, help="kernel sources to compare against")
    p.add_argument(
        "--gap",
        type=int,
        default=0,
        help="pool blocks between two of the sequence's (3: as four streams decoding together "
        "leave them); 0: one contiguous run",
    )
    p.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: CPU time of this thread, meaningful with --threads 1 on a shared machine",
    )
    args = p.parse_args()
    if args.clock == "thread":
        assert args.threads == 1, "--clock thread counts this thread only: use --threads 1"
        CLOCK[0] = time.thread_time
    torch.set_num_threads(args.threads)
    native = kernels.load()
    assert native is not None, "the kernels do not build here"
    builds = {"this": native}
    if args.baseline:
        builds["baseline"] = build_from(args.baseline)
    models = {}
    for f in args.files:
        m = load_model(str(f), device="cpu").model
        assert isinstance(m, QuantizedLlama), f"{f} does not run on the kernels"
        models[f.name] = m
    runs: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    with torch.inference_mode():
        for m in models.values():  # warm-up: page in weights, start the thread pool
            profile(m, native, args.tokens, args.context, args.gap)
        for _ in range(args.repeats):
            for name, m in models.items():
                for tag, k in builds.items():
                    runs[name, tag].append(profile(m, k, args.tokens, args.context, args.gap))
    cfg = next(iter(models.values())).config
    c, i = cfg.hidden_size, cfg.intermediate_size
    qkv_n = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    macs = {"gemm_qkv": qkv_n * c, "gemm_o": cfg.num_heads * cfg.head_dim * c}
    macs |= {"gemm_gate_up": 2 * i * c, "gemm_down": i * c}
    print(json.dumps({"load1": os.getloadavg()[0], "isa": native.isa, "threads": args.threads}))
    for (name, tag), rs in runs.items():
        med = {s: statistics.median(r[s] for r in rs) for s in rs[0]}
        row: dict[str, object] = {"file": name, "build": tag}
        row["prefill_tok_s"] = round(args.tokens / med["forward"], 1)
        row["ms"] = {s: round(1e3 * v, 1) for s, v in med.items()}
        row["share"] = {
            s: round(v / med["total"], 3) for s, v in med.items() if s not in ("total", "forward")
        }
        flops = {s: 2 * n * args.tokens * cfg.num_layers / med[s] / 1e9 for s, n in macs.items()}
        row["gemm_gflop_s"] = {s: round(v, 1) for s, v in flops.items()}
        if tag != "this":
            row["this_vs_baseline"] = round(med["forward"] / statistics.median(
                r["forward"] for r in runs[name, "this"]), 3)  # fmt: skip
        print(json.dumps(row))
    print(json.dumps({"load1_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
