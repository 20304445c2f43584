"""The event throughput one Redis primary sustains through the worker's PUBLISH path.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python -m ops.bench.publish_probe                       # private redis-server
    .venv/bin/python -m ops.bench.publish_probe --events-url redis://host:6379/0 --seconds 10

``--streams`` request streams, each written like a decode loop writes it: one ``PUBLISH`` script
call per step (lease + cancel flag MGET, one XADD of a one-token ``TextDelta`` entry), all
streams of a step pipelined in one round trip, steps back to back from ``--clients`` concurrent
connections (several worker processes' worth). Reports entries/s (= tokens/s at one token per
step), Redis commands per entry, and the Redis server's CPU (% of one core): the entries/s at
which that CPU reaches 100 % is what one primary sustains. ``--events-url`` is passed through to
redis-py as is (a cluster URL needs a client that speaks it). Not a test: prints Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from ops.bench.stream_nodes import start_redis
from shared import keys
from shared.codec import encode_events
from shared.events import TextDelta
from shared.protocol import PUBLISH


async def client_loop(redis: aioredis.Redis, sha: str, rids: list[str], until: float) -> int:
    body = encode_events([TextDelta(text=" token", token_ids=[1])])
    steps = 0
    while time.monotonic() < until:
        async with redis.pipeline(transaction=False) as pipe:
            for rid in rids:
                keys_ = [keys.events(rid), keys.lease(rid), keys.cancel(rid)]
                pipe.evalsha(sha, 3, *keys_, "w", 5000, 100_000, 0, 2, body)  # type: ignore[arg-type]
            await pipe.execute()
        steps += 1
    return steps * len(rids)


async def probe(url: str, streams: int, clients: int, seconds: float) -> None:
    redis = aioredis.Redis.from_url(url)
    sha = await redis.script_load(PUBLISH)
    info = await redis.info("cpu")
    stats0 = sum(int(v["calls"]) for v in (await redis.info("commandstats")).values())
    cpu0 = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    t0 = time.monotonic()
    groups = [[f"req_probe_{c}_{i}" for i in range(streams // clients)] for c in range(clients)]
    conns = [aioredis.Redis.from_url(url) for _ in groups]
    counts = await asyncio.gather(
        *(client_loop(c, sha, g, t0 + seconds) for c, g in zip(conns, groups, strict=True))
    )
    elapsed = time.monotonic() - t0
    info = await redis.info("cpu")
    cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"]) - cpu0
    stats = sum(int(v["calls"]) for v in (await redis.info("commandstats")).values()) - stats0
    entries = sum(counts)
    print("| streams | clients | entries/s | Redis cmds/entry | Redis CPU % | entries/s per core |")
    print("|---|---|---|---|---|---|")
    rate = entries / elapsed
    print(
        f"| {streams} | {clients} | {rate:.0f} | {stats / entries:.2f} "
        f"| {cpu / elapsed * 100:.0f} | {rate / max(cpu / elapsed, 1e-9):.0f} |"
    )
    for conn in conns:
        await conn.aclose()
    await redis.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--events-url", default=None, help="the events Redis (default: a private one)")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-probe-") as tmp:
        server = None
        url = args.events_url
        if url is None:
            server, url = start_redis(Path(tmp))
        try:
            asyncio.run(probe(url, args.streams, args.clients, args.seconds))
        finally:
            if server is not None:
                server.terminate()
                server.wait(10)


if __name__ == "__main__":
    main()
