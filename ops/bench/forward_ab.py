"""Two kernel builds, whole decode forwards: this checkout's against another's, call by call.

Runs the default model's forward (the C kernels, ``--threads`` threads) on hand-built batches
over a filled paged cache, the shapes of a speculative step (``--shapes``: rows per sequence,
e.g. ``2,1,1,1`` for four streams and one draft row), alternating this checkout's build and the
one compiled from ``--baseline DIR`` (another checkout's ``services/worker/kernels``; same ABI)
on every call, which order going first alternating by round. The logits must be the same bits
under both builds. Prints, per shape, each build's median and the speedup. Run it once with
``--baseline services/worker/kernels`` (the same sources) to see the offset between the loaded
build and a second copy: on an AVX2 EPYC the loaded one measured 0.95-0.975x its copy.

    .venv/bin/python -m ops.bench.forward_ab --baseline /tmp/old/services/worker/kernels \\
        --context 900 --rounds 31 --shapes 1 5 1,1,1,1 2,1,1,1 2,2,2,2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ops.bench.machine_load import emit
from ops.bench.prefill_profile import build_from
from ops.bench.row_cost import decode_batch, filled
from services.worker.models.kernel_llama import QuantizedLlama
from services.worker.torch_backend import TorchBackend
from shared.config import Settings


def main() -> None:
    """Parse arguments, fill the cache, alternate the builds on every shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline", type=Path, required=True, help="kernel sources to set against"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=900, help="cached tokens per sequence")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument(
        "--shapes", nargs="+", default=["1", "5", "1,1,1,1", "2,1,1,1", "2,2,2,2", "5,1,1,1"]
    )
    args = parser.parse_args()
    shapes = [[int(n) for n in s.split(",")] for s in args.shapes]
    b = TorchBackend.load(Settings(threads=args.threads, max_batch=8), "smollm2", None)
    cache, model = b.scheduler.cache, b.scheduler.model
    assert isinstance(model, QuantizedLlama), "the default model does not run on the kernels here"
    builds = {"this": model.kernels, "baseline": build_from(args.baseline)}
    builds["baseline"].compute_threads = model.kernels.compute_threads  # torch keeps one thread
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        tables = filled(b, max(len(s) for s in shapes), args.context)
        for r in range(args.rounds):
            for shape in shapes:
                ids, batch = decode_batch(b, tables, shape, args.context)
                logits = {}
                for name in list(builds) if r % 2 == 0 else list(builds)[::-1]:
                    model.kernels = builds[name]
                    began = time.perf_counter()
                    logits[name] = model(ids, batch, cache)
                    times.setdefault((str(shape), name), []).append(time.perf_counter() - began)
                if not torch.equal(logits["this"], logits["baseline"]):
                    raise SystemExit(f"{shape}: the builds' logits differ")
    model.kernels = builds["this"]
    for shape in shapes:
        this, base = (statistics.median(times[str(shape), n]) for n in ("this", "baseline"))
        emit(
            {
                "rows": shape,
                "this_ms": round(this * 1e3, 2),
                "baseline_ms": round(base * 1e3, 2),
                "speedup": round(base / this, 3),
                "same_bits": True,
            }
        )


if __name__ == "__main__":
    main()
