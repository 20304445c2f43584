"""Constrained vs free decoding: decode tok/s with a JSON-schema constraint, and TTFT of a schema.

Runs the real ``TorchBackend`` on the default model. For each batch size, the same prompts are
decoded free (greedy, EOS ignored) and under a JSON schema that cannot end before
``--tokens`` tokens (an array of at least 200 small objects: structural tokens, keys, enums,
numbers and short strings, the expensive mix for a mask), alternating free/constrained
``--rounds`` times so both see the same machine load; every stream generates exactly
``--tokens`` tokens. Decode rate = streams / the median decode step while every stream of the
batch was decoding. Time to first token is measured for one stream, free, with a schema never
seen (compiled) and with the same schema again (cached), and the compile and first mask alone.
Prints one JSON object per measurement and the load average around it: the machine is shared,
so read the ratios, measured in one run.

    .venv/bin/python -m ops.bench.constrained --threads 2 --tokens 96 --batches 1 16
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time
import uuid

import msgspec
import torch

from ops.bench.engine import emit, fresh, request, timed
from services.worker.constrain import MaskStats
from services.worker.torch_backend import TorchBackend
from shared.config import Settings
from shared.jobs import Constraint, Job


def schema(nonce: str = "") -> dict[str, object]:
    """An array of >= 200 records: the answer cannot end before any ``--tokens`` used here."""
    item = {
        "type": "object",
        "properties": {
            f"name{nonce}": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": [f"name{nonce}", "age", "role"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": item, "minItems": 200}


def constrained(job: Job, nonce: str = "") -> Job:
    constraint = Constraint(kind="json_schema", json_schema=schema(nonce))
    return msgspec.structs.replace(job, constraint=constraint, ignore_eos=False)


async def stamps(b: TorchBackend, job: Job) -> list[tuple[float, int]]:
    """(arrival time, generated tokens) of each event batch of one job."""
    out: list[tuple[float, int]] = []
    async for batch in b.generate(job, [], 1):
        out.append((time.perf_counter(), sum(len(getattr(e, "token_ids", ())) for e in batch)))
    return out


async def decode_rate(b: TorchBackend, jobs: list[Job]) -> tuple[float, float, int]:
    """(decode tok/s, median seconds per step, fewest tokens of a stream) while all decode.

    Each stream gets one token per decode step, so the gaps between its token arrivals are step
    times. Taken over the window from the last stream's first token to the first stream's end
    (staggered prefills and early finishers excluded), their median shrugs off the spikes a
    shared machine adds; the rate is streams / median step.
    """
    fresh(b)
    runs = await asyncio.gather(*(stamps(b, j) for j in jobs))
    begin, end = max(r[0][0] for r in runs), min(r[-1][0] for r in runs)
    gaps = [
        (t1 - t0) / n
        for r in runs
        for (t0, _), (t1, n) in itertools.pairwise(r)
        if begin <= t0 and t1 <= end and n
    ]
    step = statistics.median(gaps)
    return len(jobs) / step, step, min(sum(n for _, n in r) for r in runs)


async def ttft(b: TorchBackend, job: Job) -> float:
    fresh(b)
    t0 = time.perf_counter()
    first, *_ = await timed(b, job)
    return first - t0


async def bench(args: argparse.Namespace) -> None:
    settings = Settings(threads=args.threads, max_batch=max(args.batches), device=args.device)
    b = TorchBackend.load(settings, args.model, None)
    await b.start()
    try:
        await timed(b, constrained(request(b, 0, 4)))  # warm-up, llguidance tokenizer built
        for batch in args.batches:
            free_jobs = [request(b, i, args.tokens) for i in range(batch)]
            rates: dict[str, list[float]] = {"free": [], "json_schema": []}
            step_s: list[float] = []
            load0 = os.getloadavg()[0]
            b.constrainer.stats = MaskStats()
            for k in range(args.rounds):  # alternate which goes first: load drifts
                for kind in ("free", "json_schema") if k % 2 == 0 else ("json_schema", "free"):
                    jobs = free_jobs if kind == "free" else [constrained(j) for j in free_jobs]
                    rate, per_step, n = await decode_rate(b, jobs)
                    assert n == args.tokens, f"a {kind} stream ended after {n} tokens"
                    rates[kind].append(rate)
                    if kind == "free":
                        step_s.append(per_step)
            free, json_schema = (statistics.median(rates[k]) for k in ("free", "json_schema"))
            stats = b.constrainer.stats
            us = 1e6 / max(stats.steps, 1)
            emit(
                {
                    "metric": "decode_tok_s",
                    "batch": batch,
                    "tokens": args.tokens,
                    "free": round(free, 1),
                    "json_schema": round(json_schema, 1),
                    "ratio": round(json_schema / free, 3),
                    "pair_ratios": [
                        round(c / f, 3)
                        for f, c in zip(rates["free"], rates["json_schema"], strict=True)
                    ],
                    "free_step_ms": round(1000 * statistics.median(step_s), 2),
                    "mask_fill_us_per_step": round(stats.fill_s * us, 1),
                    "mask_wait_us_per_step": round(stats.wait_s * us, 1),
                    "mask_apply_us_per_step": round(stats.apply_s * us, 1),
                    "critical_path_share": round(
                        (stats.wait_s + stats.apply_s)
                        / max(stats.steps, 1)
                        / statistics.median(step_s),
                        4,
                    ),
                    "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                }
            )
        one = request(b, 1, 1)
        rows: dict[str, list[float]] = {"free": [], "new_schema": [], "cached_schema": []}
        for _ in range(args.rounds):
            nonce = uuid.uuid4().hex[:8]
            rows["free"].append(await ttft(b, one))
            rows["new_schema"].append(await ttft(b, constrained(one, nonce)))
            rows["cached_schema"].append(await ttft(b, constrained(one, nonce)))
        compile_ms: dict[str, list[float]] = {"new": [], "cached": [], "first_mask_new": []}
        for _ in range(args.rounds):
            nonce = uuid.uuid4().hex[:8]
            for kind in ("new", "cached"):
                t0 = time.perf_counter()
                state = b.constrainer.state(
                    constrained(one, nonce), b.card, in_reasoning=False, resume=[]
                )
                compile_ms[kind].append(1000 * (time.perf_counter() - t0))
                if kind == "new":
                    t0 = time.perf_counter()
                    pending = b.constrainer.begin([state])
                    assert pending is not None
                    pending.result()
                    compile_ms["first_mask_new"].append(1000 * (time.perf_counter() - t0))
        emit(
            {
                "metric": "schema_ms",
                **{k: round(statistics.median(v), 3) for k, v in compile_ms.items()},
            }
        )
        emit(
            {
                "metric": "ttft_ms",
                "prompt_tokens": len(one.prompt_token_ids),
                **{k: round(1000 * statistics.median(v), 1) for k, v in rows.items()},
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
        )
    finally:
        await b.stop()


def main() -> None:
    """Parse arguments and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    emit({"machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "threads": args.threads}})
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
