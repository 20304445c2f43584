"""Queue pickup benchmark: enqueue -> Start latency, and what a polling arq worker costs Redis.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python -m ops.bench.pickup                       # private redis-server, defaults
    .venv/bin/python -m ops.bench.pickup --jobs 100 --polls 0.5,0.05,0.01 --running 8,16
    .venv/bin/python -m ops.bench.pickup --polls 0.01 --idle 0,1.0   # without / with the doorbell
    .venv/bin/python -m ops.bench.pickup --polls 0.01 --idle 1.0 --affinity-wait-ms 50

For each ``poll_delay`` it starts a real ``sluice worker`` process serving the scripted test
double (``scripted:long?rate=2&max_batch=16``) and measures:

* pickup: ``--jobs`` requests enqueued one at a time (gaps spread over the poll period so
  enqueues do not phase-lock with the poll loop); latency = Redis entry id (ms) of the
  request's ``Start`` event minus the enqueue wall time: what a client waits for its first event;
* Redis load: ``total_commands_processed`` per second over ``--window`` seconds with the worker
  idle, and with N long-running requests in flight (N below ``max_batch``: arq keeps polling and
  re-checks every running job id on each poll; N = ``max_batch``: arq stops reading the queue);
  plus the worker process's CPU use over the same window.

By default it starts its own ``redis-server`` on a unix socket, so nobody else's traffic is
counted; ``--redis-url`` points it at an existing server instead (numbers then include others).
Not a test: it prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from arq.connections import ArqRedis

from ops.bench.stream_nodes import start_redis
from services.queue import Queue
from services.queue.consumer import arq_deserialize, arq_serialize
from services.worker.scripted import parse_spec
from shared import keys
from shared.codec import decode_entry, encode_job
from shared.events import Start, is_terminal
from shared.jobs import GenerateRequest, Job, Message, TextPart
from shared.prefix import prompt_chain
from shared.prompt import PromptRenderer

MODEL = "bench-pickup"
SPEC = "scripted:long?rate=2&max_batch=16"
# The worker runs the scripted double; its card renders prompts as the API would.
_RENDERER = PromptRenderer(parse_spec(SPEC, MODEL).card)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def commands(redis: aioredis.Redis) -> int:
    info = await redis.info("stats")
    return int(info["total_commands_processed"])


async def load(redis: aioredis.Redis, pid: int, window: float) -> tuple[float, float]:
    """Redis commands/s (minus this probe's own INFO) and worker CPU % over ``window``."""
    c0, t0, cpu0 = await commands(redis), time.monotonic(), cpu_seconds(pid)
    await asyncio.sleep(window)
    c1, t1, cpu1 = await commands(redis), time.monotonic(), cpu_seconds(pid)
    return (c1 - c0 - 1) / (t1 - t0), 100 * (cpu1 - cpu0) / (t1 - t0)


def job(rid: str, script: str, max_tokens: int | None) -> Job:
    """The job the API would enqueue, rendered and tokenized with the scripted card."""
    request = GenerateRequest(
        request_id=rid,
        model=MODEL,
        messages=[Message(role="user", content=[TextPart("hi")])],
        metadata={"script": script},
        max_tokens=max_tokens,
        created=time.time(),
    )
    rendered = _RENDERER.render(request)
    return Job.of(request, prompt_token_ids=list(rendered.token_ids), prompt_text=rendered.text)


async def enqueue(arq: ArqRedis, j: Job, affinity_ms: int = 0) -> float:
    """What the API does: the request record, then the enqueue script (which rings the queue's
    doorbell), with the prompt's chain when cache-aware pickup is on."""
    payload = encode_job(j)
    await arq.hset(keys.request(j.request_id), mapping={"job": payload})  # type: ignore[misc]
    t0 = time.time()
    chain = prompt_chain(MODEL, j.prompt_token_ids, 16) if affinity_ms else None
    await Queue(arq).enqueue(
        MODEL, j.request_id, payload, enqueue_ms=int(t0 * 1000), expires_ms=60_000,
        bound=10_000, prefix=chain, affinity_wait_ms=affinity_ms,
    )  # fmt: skip
    return t0


async def first_and_last(redis: aioredis.Redis, rid: str) -> tuple[int, bool]:
    """Block until the Start event; return its entry time (ms) once the stream has ended."""
    last, start_ms = "0-0", -1
    while True:
        for _, entries in await redis.xread({keys.events(rid): last}, block=5000):
            for entry_id, fields in entries:
                last = entry_id.decode()
                events = decode_entry(fields)
                if isinstance(events[0], Start):
                    start_ms = int(last.split("-")[0])
                if is_terminal(events[-1]):
                    return start_ms, True


async def bench_poll(
    url: str, poll: float, idle: float, n_jobs: int, running: list[int], window: float,
    affinity_ms: int = 0,
) -> str:  # fmt: skip
    env = {**os.environ, "SLUICE_REDIS_URL": url, "SLUICE_POLL_DELAY_S": str(poll)}
    env["SLUICE_IDLE_POLL_S"] = str(idle)
    env["SLUICE_AFFINITY_WAIT_MS"] = str(affinity_ms)
    env["SLUICE_LOG_LEVEL"] = "warning"
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "worker", "--model", SPEC, "--name", MODEL, env=env
    )
    redis = aioredis.Redis.from_url(url)
    arq = ArqRedis.from_url(url)
    arq.job_serializer, arq.job_deserializer = arq_serialize, arq_deserialize
    try:
        for _ in range(600):
            if await redis.exists(keys.model_card(MODEL)):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # let start-up traffic settle
        idle_ops, idle_cpu = await load(redis, worker.pid, window)
        latencies: list[float] = []
        for i in range(n_jobs):
            rid = f"pick-{poll}-{idle}-{i}"
            t0 = await enqueue(arq, job(rid, "text", 0), affinity_ms)
            start_ms, _ = await first_and_last(redis, rid)
            latencies.append(start_ms - t0 * 1000)
            # Spread enqueue times over the whole poll period: a fixed gap after each job would
            # phase-lock with the poll loop (the job ends right after a poll) and skew the result.
            await asyncio.sleep(0.005 + poll * (i * 7919 % 100) / 100)
        latencies.sort()
        q = statistics.quantiles(latencies, n=10)
        row = f"| {poll} | {idle or 'off'} | {statistics.median(latencies):.1f} | {q[8]:.1f} "
        row += f"| {latencies[-1]:.1f} | {idle_ops:.0f} | {idle_cpu:.1f}"
        for n in running:
            rids = [f"run-{poll}-{idle}-{n}-{i}" for i in range(n)]
            for rid in rids:
                await enqueue(arq, job(rid, "long", None), affinity_ms)
            await asyncio.sleep(1.0)  # all picked up
            ops, cpu = await load(redis, worker.pid, window)
            row += f" | {ops:.0f} | {cpu:.1f}"
            for rid in rids:
                await redis.set(keys.cancel(rid), 1, ex=60)
            for rid in rids:
                await first_and_last(redis, rid)
        return row + " |"
    finally:
        worker.send_signal(signal.SIGTERM)
        await asyncio.wait_for(worker.wait(), 30)
        await arq.aclose()
        await redis.aclose()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--redis-url", default=None, help="default: a private redis-server")
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--polls", default="0.5,0.05,0.01")
    p.add_argument("--idle", default="0,1.0", help="SLUICE_IDLE_POLL_S values (0: no doorbell)")
    p.add_argument("--running", default="8,16", help="in-flight counts to measure load with")
    p.add_argument("--window", type=float, default=5.0, help="seconds per load measurement")
    p.add_argument(
        "--affinity-wait-ms", type=int, default=0,
        help="SLUICE_AFFINITY_WAIT_MS of the worker and the enqueues (0: cache-aware pickup off)",
    )  # fmt: skip
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks below
    running = [int(n) for n in args.running.split(",")]
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        server, url = (None, args.redis_url) if args.redis_url else start_redis(Path(tmp))
        try:
            head = "| poll_delay s | doorbell (idle poll s) | pickup p50 ms | p90 ms | max ms"
            head += " | idle ops/s | idle CPU %"
            for n in running:
                head += f" | ops/s, {n} running | CPU %, {n} running"
            print(head + " |")
            print("|" + "---|" * (head.count("|")))
            for poll in [float(x) for x in args.polls.split(",")]:
                for idle in [float(x) for x in args.idle.split(",")]:
                    row = await bench_poll(
                        url, poll, idle, args.jobs, running, args.window, args.affinity_wait_ms
                    )
                    print(row, flush=True)
        finally:
            if server is not None:
                server.terminate()
                server.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
