"""One stream's decode step on the CPU kernels against the tokens already cached, in one process.

For a GGUF on the kernels, times a decode step (B = 1) with ``--contexts`` tokens in the cache,
the contexts taking turns step by step, so the VM's drift hits them alike. With ``--widen``, a
second copy of the model has its half scales (``SL_H16``) widened back to floats and takes its
turn beside the first (the same weights and logits: the bytes of the scales are what differs),
and the ratio is printed. Medians in ms, as JSON lines. Run it on an idle machine.

    .venv/bin/python -m ops.bench.decode_context /tmp/q/smollm2-Q4_0.gguf --contexts 1,250,1000

``--batch B`` decodes B sequences in each step instead of one: they share the context's blocks
(an agent's common system prompt, the prefix cache's sharing) and each writes its own next
block, so B = 32 at 4,000 tokens is the agent-sessions benchmark's decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from services.worker.kernels import Layer
from services.worker.kv_cache import AttentionBatch, PagedKVCache, SeqRows, build_batch
from services.worker.loaders import load_model
from services.worker.models.blocks import H16
from services.worker.models.kernel_llama import QuantizedLlama

CPU = torch.device("cpu")
BLOCK = 16  # the scheduler's default block size


def widen(model: QuantizedLlama) -> int:
    """Turn every half-scaled linear back to float scales; the number widened."""
    linears = [model.head, *(x for b in model.blocks for x in (b.qkv, b.o_proj, b.gate_up, b.down))]
    widened = 0
    for linear in linears:
        if linear.layout & H16:
            linear.d = linear.d.float()
            linear.m = None if linear.m is None else linear.m.float()
            linear.layout &= ~H16
            linear.view = linear.struct()
            widened += 1
    model.layer_structs = (Layer * len(model.blocks))(*(b.struct() for b in model.blocks))
    model.struct.layer = model.layer_structs
    model.struct.head = model.head.view
    return widened


def filled(
    model: QuantizedLlama, ctx: int, batch: int = 1
) -> tuple[PagedKVCache, AttentionBatch, torch.Tensor]:
    """A paged cache holding one sequence's ``ctx`` prefilled tokens (its blocks in order), the
    batch of the next decode step (position ``ctx``) of ``batch`` sequences that share its full
    blocks, and the prefill's last logits."""
    c = model.config
    blocks = -(-(ctx + 1) // BLOCK) + batch - 1
    cache = PagedKVCache(
        layers=c.num_layers, num_blocks=blocks, block_size=BLOCK, kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, dtype=model.kv_dtype, device=CPU,
    )  # fmt: skip
    table = cache.extend([], blocks)
    ids = torch.randint(0, 1000, (ctx,), generator=torch.Generator().manual_seed(0))
    shared = table[: -(-(ctx + 1) // BLOCK)]
    logits = model(ids, build_batch([SeqRows(0, shared, 0, ctx)], BLOCK, CPU), cache)
    full, own = (
        shared[: ctx // BLOCK],
        [shared[ctx // BLOCK :], *([b] for b in table[len(shared) :])],
    )
    if ctx % BLOCK and batch > 1:
        raise SystemExit("--batch needs contexts that are multiples of the block size (16)")
    seqs = [SeqRows(i, full + own[i], ctx, 1) for i in range(batch)]
    return cache, build_batch(seqs, BLOCK, CPU), logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path)
    p.add_argument("--contexts", default="1,250,1000")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="sequences per step, sharing the context")
    p.add_argument("--widen", action="store_true", help="also time float scales (vs SL_H16)")
    args = p.parse_args()
    torch.set_num_threads(1)  # as the worker: torch's own work is microseconds
    variants: dict[str, QuantizedLlama] = {}
    for name in ("h16", "f32") if args.widen else ("h16",):
        model = load_model(str(args.file), device="cpu").model
        assert isinstance(model, QuantizedLlama), f"{args.file} does not run on the kernels"
        model.kernels.compute_threads = args.threads
        variants[name] = model
    widened = widen(variants["f32"]) if args.widen else 0
    contexts = [int(c) for c in args.contexts.split(",")]
    runs = []
    with torch.inference_mode():
        for ctx in contexts:
            first = None
            for name, model in variants.items():
                cache, batch, logits = filled(model, ctx, args.batch)
                assert first is None or torch.equal(logits, first), "the variants disagree"
                first = logits
                runs.append((name, ctx, model, cache, batch))
        times: dict[tuple[str, int], list[float]] = {(n, c): [] for n, c, *_ in runs}
        token = torch.full((args.batch,), 5)
        for _ in range(args.steps):
            for name, ctx, model, cache, batch in runs:
                began = time.perf_counter()
                model(token, batch, cache)
                times[name, ctx].append(time.perf_counter() - began)
    head = {"file": args.file.name, "load1": os.getloadavg()[0], "widened": widened}
    print(json.dumps(head | {"batch": args.batch}))
    for ctx in contexts:
        row: dict[str, object] = {"context": ctx}
        for name in variants:
            row[f"{name}_ms"] = round(1000 * statistics.median(times[name, ctx]), 3)
        if args.widen:
            row["f32_over_h16"] = round(float(row["f32_ms"]) / float(row["h16_ms"]), 3)  # type: ignore[arg-type]
        print(json.dumps(row))


if __name__ == "__main__":
    main()
