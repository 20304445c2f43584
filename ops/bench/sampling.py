"""The cost of choosing a token, per sampling setting, against the textbook implementation.

``sample_next_token`` (top_p from the best 64, then 1,024 tokens, a draw by inverting the
cumulative sum) against sorting the whole vocabulary for top_p and ``torch.multinomial``, on one
thread (the worker's torch thread), over a vocabulary of ``--vocab`` (default SmolLM2's 49,152)
random logits scaled by ``--width`` (larger: flatter, wider nuclei). Medians in microseconds and
the baseline's time over ours, as JSON lines.

    .venv/bin/python -m ops.bench.sampling
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from services.worker.sampling import SamplingConfig, sample_next_token

SETTINGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.2, top_p=0.9),
    SamplingConfig(temperature=0.7, top_k=50, top_p=0.95),
    SamplingConfig(temperature=0.6, top_p=0.95, min_p=0.05),
    SamplingConfig(temperature=1.5, top_p=0.99),
]


def textbook(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> int:
    """Sort everything for top_p, then ``torch.multinomial``."""
    out = logits / cfg.temperature
    if 0 < cfg.top_k < out.numel():
        out = out.masked_fill(out < torch.topk(out, cfg.top_k).values[-1], float("-inf"))
    if cfg.top_p < 1.0:
        ordered, order = torch.sort(out, descending=True)
        probs = torch.softmax(ordered, -1)
        drop = torch.zeros_like(out, dtype=torch.bool)
        drop[order] = torch.cumsum(probs, -1) - probs >= cfg.top_p
        out = out.masked_fill(drop, float("-inf"))
    if cfg.min_p > 0.0:
        probs = torch.softmax(out, -1)
        out = out.masked_fill(probs < cfg.min_p * probs.max(), float("-inf"))
    return int(torch.multinomial(torch.softmax(out, -1), 1, generator=gen))


def median_us(fn: Callable[[], int], n: int) -> float:
    times = []
    for _ in range(n):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1e6 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49_152)
    p.add_argument("--width", type=float, default=3.0)
    p.add_argument("--draws", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.vocab, generator=gen) * args.width
    for cfg in SETTINGS:
        ours = median_us(partial(sample_next_token, logits, cfg, gen), args.draws)
        base = median_us(partial(textbook, logits, cfg, gen), args.draws)
        row = {
            "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
            "min_p": cfg.min_p, "ours_us": round(ours), "textbook_us": round(base),
            "textbook_over_ours": round(base / ours, 2),
        }  # fmt: skip
        print(json.dumps(row))


if __name__ == "__main__":
    main()
