"""What a CPU forward costs per token row and per sequence: the speculator's cost model.

Runs the default model's forward (the C kernels, ``--threads`` threads) on hand-built batches
over a filled paged cache: one sequence with 1-5 rows (a decode row and draft rows), 4 and 8
sequences with 1-5 rows each. ``draft_pacing.DraftPacer`` models a step as ``BASE + rows`` in
units of a sequence's first extra row, the dearest (printed last as ``pacer``: the unit from one
sequence's 1 and 2 rows); the least-squares line over every shape (``fit``) is printed beside it
with its per-sequence term: rows get cheaper as a batch grows, and each sequence's attention
adds with its context. Prints one JSON object per shape (median and minimum of ``--repeats``):

    .venv/bin/python -m ops.bench.row_cost --threads 2 --context 400
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from ops.bench.machine_load import emit, load_probe
from services.worker.kv_cache import AttentionBatch, SeqRows, build_batch
from services.worker.torch_backend import TorchBackend
from shared.config import Settings

SHAPES = [[1], [2], [3], [4], [5], [1] * 2, [1] * 4, [2] * 4, [3] * 4, [5] * 4, [5, 1, 1, 1]]


def filled(b: TorchBackend, seqs: int, context: int) -> list[list[int]]:
    """``seqs`` sequences' block tables (ids 1000, 1001, ..), each holding ``context`` cached
    tokens, read as one prompt."""
    cache, size = b.scheduler.cache, b.scheduler.cache.block_size
    tables = [cache.extend([], (context + 8) // size + 1) for _ in range(seqs)]
    for i, table in enumerate(tables):
        ids = torch.randint(100, 10000, (context,))
        prompt = build_batch([SeqRows(1000 + i, table, 0, context, 1)], size, torch.device("cpu"))
        b.scheduler.model(ids, prompt, cache)
    return tables


def decode_batch(
    b: TorchBackend, tables: list[list[int]], shape: list[int], context: int
) -> tuple[torch.Tensor, AttentionBatch]:
    """Token ids and the batch of a step after ``context`` cached tokens (``filled``): sequence
    ``i`` with ``shape[i]`` rows (a decode row and draft rows), logits for each."""
    spans = [SeqRows(1000 + i, tables[i], context, n, n) for i, n in enumerate(shape)]
    batch = build_batch(spans, b.scheduler.cache.block_size, torch.device("cpu"))
    return torch.randint(100, 10000, (sum(shape),)), batch


def main() -> None:
    """Parse arguments, fill the cache, time the shapes and fit the model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=400, help="cached tokens per sequence")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b = TorchBackend.load(Settings(threads=args.threads, max_batch=8), "smollm2", None)
    cache, model = b.scheduler.cache, b.scheduler.model
    measured: list[tuple[int, int, float]] = []  # (sequences, rows, median seconds)
    by_shape: dict[str, float] = {}
    with torch.inference_mode():
        tables = filled(b, 8, args.context)
        for shape in [*SHAPES, [1] * 8]:
            ids, batch = decode_batch(b, tables, shape, args.context)
            times, load = [], dict[str, Any]()
            with load_probe([], load):
                for _ in range(args.repeats):
                    began = time.perf_counter()
                    model(ids, batch, cache)
                    times.append(time.perf_counter() - began)
            median = statistics.median(times)
            measured.append((len(shape), sum(shape), median))
            by_shape[str(shape)] = median
            emit({"rows": shape, "median_ms": round(median * 1e3, 2),
                  "min_ms": round(min(times) * 1e3, 2), **load})  # fmt: skip
    # least squares for t = base + per_seq * S + per_row * R, then in units of per_row
    x = torch.tensor([[1.0, s, r] for s, r, _ in measured], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in measured], dtype=torch.float64)
    base, per_seq, per_row = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.flatten().tolist()
    fit = {"base": base, "per_seq": per_seq, "per_row": per_row}
    unit = by_shape["[2]"] - by_shape["[1]"]
    emit({"pacer": {"unit_ms": round(unit * 1e3, 2), "BASE": round(by_shape["[1]"] / unit - 1, 2)}})
    emit(
        {
            "fit_ms": {k: round(v * 1e3, 2) for k, v in fit.items()},
            "in_rows": {"base": round(base / per_row, 2), "per_seq": round(per_seq / per_row, 2)},
        }
    )


if __name__ == "__main__":
    main()
