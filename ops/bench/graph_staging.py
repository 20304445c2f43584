"""Host time a replayed decode step spends staging its inputs: ``DecodeGraphs.stage`` against
writing every sequence's whole block table (what ``run`` did before), in one run on the CPU.

B sequences with tables of about ``--blocks`` blocks, each gaining a block once in 16 steps
(staggered, as 16-token blocks fill), ``--steps`` steps; each way's time a step is the best of
``--repeats`` runs less the loop's own cost. Prints one JSON object:

    .venv/bin/python -m ops.bench.graph_staging --batch 256 --blocks 72
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from ops.bench.machine_load import emit
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.kv_cache import PagedKVCache, SeqRows


def rewrite_all(graphs: DecodeGraphs, ids: list[int], spans: list[SeqRows]) -> None:
    """The staging ``run`` did before: every row's whole table, every step."""
    host_ids, host_pos, host_tab = (
        graphs._ids.numpy(),
        graphs._positions.numpy(),
        graphs._tables.numpy(),
    )
    host_ids[: len(ids)] = ids
    for i, s in enumerate(spans):
        host_pos[i] = s.start
        host_tab[i, : len(s.table)] = s.table


def timed(
    graphs: DecodeGraphs,
    stage: Callable[[list[SeqRows]], object],
    args: argparse.Namespace,
    seed: int,
) -> float:
    """Seconds a step of ``stage`` over growing tables, loop included."""
    rng = np.random.default_rng(seed)
    b = args.batch
    tables = [rng.integers(0, 30000, size=args.blocks - i % 8).tolist() for i in range(b)]
    graphs._staged = [None] * len(graphs._staged)
    began = time.perf_counter()
    for step in range(args.steps):
        for i in range(step % 16, b, 16):
            tables[i].append(int(rng.integers(0, 30000)))
        stage([SeqRows(i, tables[i], 1000 + step, 1) for i in range(b)])
    return (time.perf_counter() - began) / int(args.steps)


def main() -> None:
    """Parse arguments and measure both ways."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--blocks", type=int, default=72, help="a table's blocks at the start")
    p.add_argument("--steps", type=int, default=112)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    cache = PagedKVCache(
        layers=1, num_blocks=4, block_size=16, kv_heads=1, head_dim=8,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    width = args.blocks + args.steps // 16 + 1
    graphs = DecodeGraphs(lambda *_: torch.empty(0), cache, max_batch=args.batch, max_blocks=width)
    ids = list(range(args.batch))
    ways: dict[str, Callable[[list[SeqRows]], object]] = {
        "loop": lambda spans: None,
        "rewrite_all": lambda spans: rewrite_all(graphs, ids, spans),
        "stage": lambda spans: graphs.stage(ids, spans, args.batch),
    }
    best = {
        name: min(timed(graphs, f, args, r) for r in range(args.repeats))
        for name, f in ways.items()
    }
    before, after = best["rewrite_all"] - best["loop"], best["stage"] - best["loop"]
    emit(
        {
            "batch": args.batch,
            "blocks": args.blocks,
            "rewrite_all_us": round(before * 1e6, 1),
            "stage_us": round(after * 1e6, 1),
            "ratio": round(before / after, 2),
        }
    )


if __name__ == "__main__":
    main()
