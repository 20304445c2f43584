"""The worker's event-loop CPU per generated token, with and without ``PublishPipe``.

A real worker (``start_worker``) runs in this process on a private ``redis-server`` with the
default model; ``--streams`` requests of ``--tokens`` greedy tokens each are enqueued at once,
so they decode as one batch. The decode loop runs on its own thread; the event loop's thread
does everything else (publishing, arq, heartbeats), so its CPU time (``time.thread_time``) over
the run, per generated token, is what publishing costs the worker. Runs alternate between the
pipe (a step's publishes in one pipeline) and one ``PUBLISH`` call per sequence per step; the
medians, their ratio and the round trips per entry are printed as JSON.

    .venv/bin/python -m ops.bench.publish_pipe --streams 16 --tokens 96 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from arq.connections import ArqRedis

from ops.bench.stream_nodes import start_redis
from services.queue.arq_keys import JOB_FUNCTION
from services.queue.consumer import arq_serialize
from services.worker.main import load_backend, start_worker
from shared import keys
from shared.codec import encode_job
from shared.config import Settings
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart
from shared.prompt import PromptRenderer


async def one_run(
    url: str, settings: Settings, backend: Any, piped: bool, args: argparse.Namespace
) -> dict[str, Any]:
    redis = aioredis.Redis.from_url(url)
    await redis.flushdb()
    worker = await start_worker(settings, backend)
    pipe = worker.wc.pipe
    if not piped:
        worker.wc.pipe = None
    arq = ArqRedis.from_url(url)
    arq.job_serializer = arq_serialize
    renderer = PromptRenderer(backend.card, backend.loaded.tokenizer)
    rids = [f"r{i}" for i in range(args.streams)]
    began_cpu = time.thread_time()
    for i, rid in enumerate(rids):
        request = GenerateRequest(
            request_id=rid,
            model=worker.name,
            messages=[Message(role="user", content=[TextPart(text=f"Tell story number {i}.")])],
            sampling=SamplingParams(temperature=0.0),
            max_tokens=args.tokens,
            ignore_eos=True,
        )
        rendered = renderer.render(request)
        job = Job.of(request, prompt_token_ids=list(rendered.token_ids), prompt_text=rendered.text)
        payload = encode_job(job)
        await arq.hset(keys.request(rid), mapping={"job": payload, "model": job.model})
        await arq.enqueue_job(JOB_FUNCTION, payload, _job_id=rid, _queue_name=keys.queue(job.model))
    for _ in range(100_000):  # until every request ran and ended (the worker has no hook)
        if worker.wc.served == len(rids) and not worker.wc.active:
            break
        await asyncio.sleep(0.02)
    cpu = time.thread_time() - began_cpu
    entries = sum([await redis.xlen(keys.events(r)) for r in rids])
    trips = pipe.round_trips if piped and pipe is not None else entries
    await worker.stop(0.5)
    await arq.aclose()
    await redis.aclose()
    return {"cpu_us_per_token": 1e6 * cpu / max(1, worker.wc.generated), "trips": trips,
            "entries": entries}  # fmt: skip


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=1, help="the decode loop's CPU threads")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_redis(Path(tmp))
        try:
            settings = Settings.from_env(
                {}, redis_url=url, max_batch=args.streams, threads=args.threads
            )
            backend = load_backend(settings, args.model, None)
            runs: dict[str, list[dict[str, Any]]] = {"pipe": [], "direct": []}
            for _ in range(args.repeats):
                for mode in ("pipe", "direct"):
                    runs[mode].append(await one_run(url, settings, backend, mode == "pipe", args))
        finally:
            server.terminate()
            server.wait()
    med = {m: statistics.median(r["cpu_us_per_token"] for r in rs) for m, rs in runs.items()}
    print(json.dumps({
        "streams": args.streams, "tokens": args.tokens, "loadavg": os.getloadavg(),
        "loop_cpu_us_per_token": med, "direct_over_pipe": med["direct"] / med["pipe"],
        "entries_per_round_trip": statistics.median(
            r["entries"] / r["trips"] for r in runs["pipe"]),
        "runs": runs,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
