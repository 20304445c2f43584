"""Micro benchmark of the CPU kernels per weight format and instruction set, on the default model.

For each GGUF given (e.g. the default Q4_1 and copies written by ``ops/bench/requantize.py``)
and each kernel build (native: AVX-512 VNNI where the CPU has it, with AMX tiles for prefill
where it has those; ``avx512vnni``: the native build without AMX, ``-DSL_NO_AMX``, timed beside
it on such a CPU; ``avx2``: -mavx2 -mfma only),
times one 190-token prefill (B = 1) and decode steps at B = 1 and B = 16 with ~200 cached tokens,
in-process, without the scheduler, on a paged cache of 16-token blocks (``--allow-dense``: files
that load as dense torch models are timed the same way; a checkout from before the paged cache
has another forward: time it with that checkout's copy of this script). Builds and files
alternate inside each repeat, so a neighbour's load hits them alike; the medians and the ratios
against the first file's native build are printed as JSON. Run it on an idle machine (``uptime``
load below ~0.5).

    .venv/bin/python -m ops.bench.kernel_formats /tmp/q4_1.gguf /tmp/q4_0.gguf /tmp/q8_0.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from services.worker import kernels
from services.worker.kernels import FLAGS, Kernels, build
from services.worker.kv_cache import AttentionBatch, PagedKVCache, SeqRows, build_batch
from services.worker.loaders import load_model
from services.worker.models.kernel_llama import QuantizedLlama

PROMPT = 190
CPU = torch.device("cpu")
BLOCK = 16  # the scheduler's default block size
AVX2 = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cache(
    model: torch.nn.Module, seqs: int, start: int, count: int
) -> tuple[PagedKVCache, AttentionBatch]:
    """A paged cache with blocks for ``seqs`` sequences of ``start + count`` tokens each (their
    tables side by side in the pool), and the batch of ``count`` new tokens of each after
    ``start`` (those before read as zeros: the cache zero-fills a fresh block)."""
    c: Any = model.config  # a LlamaConfig
    per_seq = -(-(start + count) // BLOCK)
    cache = PagedKVCache(
        layers=c.num_layers,
        num_blocks=seqs * per_seq,
        block_size=BLOCK,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=model.kv_dtype if isinstance(model, QuantizedLlama) else torch.float32,
        device=CPU,
    )
    rows = [SeqRows(i, cache.extend([], per_seq), start, count) for i in range(seqs)]
    return cache, build_batch(rows, BLOCK, CPU)


def measure(model: torch.nn.Module, steps: int) -> dict[str, float]:
    """Seconds: one prefill of PROMPT tokens, and a decode step (median) at B = 1 and 16."""
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (PROMPT,), generator=g)
    with torch.inference_mode():
        cache, batch = _cache(model, 1, 0, PROMPT)
        began = time.perf_counter()
        model(ids, batch, cache)
        out["prefill_s"] = time.perf_counter() - began
        for rows in (1, 16):
            cache, batch = _cache(model, rows, PROMPT, 1)
            tokens = torch.randint(0, 1000, (rows,), generator=g)
            times = []
            for _ in range(steps):
                began = time.perf_counter()
                model(tokens, batch, cache)
                times.append(time.perf_counter() - began)
            out[f"decode_b{rows}_s"] = statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--allow-dense", action="store_true", help="time files that load dense (torch) too"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    native = kernels.load()
    assert native is not None, "the kernels do not build here"
    builds: dict[str, Kernels] = {native.isa: native}
    if native.isa.endswith("+amx"):  # the same CPU without the tiles: what AMX buys
        no_amx = [*FLAGS, "-DSL_NO_AMX"]
        builds["avx512vnni"] = Kernels(build(flags=no_amx, directory=Path(tempfile.mkdtemp())))
    if native.isa != "avx2":
        builds["avx2"] = Kernels(build(flags=AVX2, directory=Path(tempfile.mkdtemp())))
    models: dict[str, torch.nn.Module] = {}
    for f in args.files:
        loaded = load_model(str(f), device="cpu").model
        ok = isinstance(loaded, QuantizedLlama) or args.allow_dense
        assert ok, f"{f} does not run on the kernels"
        models[f.name] = loaded
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for name, model in models.items():
            if not isinstance(model, QuantizedLlama):  # dense torch (--allow-dense)
                runs.setdefault((name, "torch"), []).append(measure(model, args.steps))
                continue
            for isa, k in builds.items():
                model.kernels = k  # the packed weights do not depend on the build
                runs.setdefault((name, isa), []).append(measure(model, args.steps))
    base: dict[str, float] | None = None
    print(json.dumps({"load1": os.getloadavg()[0], "threads": args.threads}))
    for (name, isa), rs in runs.items():
        med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        row: dict[str, object] = {"file": name, "isa": isa}
        row["prefill_tok_s"] = round(PROMPT / med["prefill_s"], 1)
        row["decode_b1_tok_s"] = round(1 / med["decode_b1_s"], 1)
        row["decode_b16_tok_s"] = round(16 / med["decode_b16_s"], 1)
        base = base or med
        row["vs_first"] = {k: round(base[k] / med[k], 3) for k in med}  # > 1: faster
        print(json.dumps(row))
    print(json.dumps({"load1_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
