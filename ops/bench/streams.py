"""API streaming benchmark: concurrent SSE streams per API process, and XADD → socket latency.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python -m ops.bench.streams                          # private redis-server
    .venv/bin/python -m ops.bench.streams --levels 250,500,1000,1500 --seconds 8
    .venv/bin/python -m ops.bench.streams --cluster                # private 3x2 Redis Cluster
    .venv/bin/python -m ops.bench.streams --api-tree /tmp/old --schema 1   # an older API tree

With ``--cluster`` the events live on a private Redis Cluster (3 primaries, 3 replicas, ports
17100-17105; the test fixture uses 17000-) and arq's queue on a private single redis-server, as a
deployment runs them; the API's hub is then ``ClusterStreamHub`` (doorbells + per-node reads from
the replicas), and the publisher writes one pipeline per primary in which every XADD is followed
by the doorbell the PUBLISH script rings (``SPUBLISH <stream> <entry id>``). Entries are schema
v2 (``e`` = a msgpack array of one step's events) unless ``--schema 1`` (for an API tree older
than v2, which refuses v2 entries).

It starts one real ``sluice api`` process (uvloop + httptools, as ``run_api`` serves it) and, per
level N, one publisher process that plays a batching worker as cheaply as possible: every 50 ms
(20 tokens/s per stream) one write of N pipelined raw-protocol XADDs, one ``TextDelta`` per
stream carrying the wall-clock time of the write. N SSE clients, all in this one process
(uvloop, an ``asyncio.Protocol`` per connection, no HTTP library), read
``GET /v1/requests/{id}/events`` and record, per event, ``receive time - XADD time`` (latency:
Redis hop, hub fan-out, projection, SSE write, loopback, and the clients' own loop) and the
added inter-event delay (how much later than its predecessor an event arrived, beyond the
50 ms the publisher put between them). A level passes when the added inter-event delay's p99 is
under 50 ms and every published event arrived; the run stops at the first failing level unless
``--keep-going``.

So that the reader can see who the limit is, each level reports the CPU used by the API, the
clients, the publisher and Redis (percent of one core; on a cluster all six nodes, and the
busiest one), the API's CPU microseconds per delivered event, the Redis commands processed per
published event (all nodes: writes, doorbells and the hub's reads), the 1-minute load average,
and how much of the wall time the API was runnable but waiting for a CPU (Linux
schedstat): when that is large, the machine, not the API process, is the bottleneck.

``--api-cpu N`` pins the API process to CPU N and this process (clients, the publisher it
starts) and a private Redis to the other CPUs (the cluster's nodes are not pinned), so on a
small machine the API does not wait for a core its own load generator holds.

A separate probe measures the idle-path latency: one stream, single XADDs 10 ms apart, time
taken immediately before each XADD, median/p90/p99 of XADD → bytes read from the API socket.

Request hashes are written directly (owner "", no arq job): nothing but the API's streaming path
is measured. Not a test: it prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis

from ops.bench.stream_load import open_client, publisher
from ops.bench.stream_nodes import Nodes, start_cluster, start_redis
from services import redis_conn
from shared import keys
from shared.codec import encode_entry, encode_event, encode_job
from shared.events import AnyEvent, Finish, Start, TextDelta, Usage
from shared.jobs import Job

_JSON = msgspec.json.Decoder()


SCHEMA = [2]  # the entry format written (--schema): 1 for an API tree that predates v2


def _entry(event: AnyEvent) -> dict[Any, Any]:
    """Stream entry fields (typed loosely: redis-py's xadd wants an invariant dict type)."""
    if SCHEMA[0] == 1:
        return {b"v": b"1", b"e": encode_event(event)}
    return dict(encode_entry(event))


def start_api(
    events_url: str, queue_url: str, port: int, tree: Path | None
) -> subprocess.Popen[bytes]:
    """``sluice api`` as its own process (uvicorn, uvloop/httptools when installed); ``tree`` is
    another checkout to run the API from (an older commit, for a before/after figure)."""
    env = {
        **os.environ,
        "SLUICE_REDIS_URL": queue_url,
        "SLUICE_EVENTS_URL": events_url,
        "SLUICE_QUEUE_URL": queue_url,
        "SLUICE_PORT": str(port),
        "SLUICE_LOG_LEVEL": "warning",
        "SLUICE_KEEPALIVE_S": "15",
    }
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-m", "services.cli", "api"]
    return subprocess.Popen(cmd, env=env, cwd=tree)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def create_requests(redis: aioredis.Redis, prefix: str, n: int) -> list[str]:
    """Request hashes as ``submit`` stores them (the API checks ownership before streaming)."""
    rids = [f"req_{prefix}_{i:05d}" for i in range(n)]
    async with redis.pipeline(transaction=False) as pipe:
        for rid in rids:
            job = Job(
                request_id=rid,
                model="bench",
                created=time.time(),
                prompt_token_ids=[1],
                prompt_text="",
            )
            pipe.hset(
                keys.request(rid), mapping={"owner": "", "model": "bench", "job": encode_job(job)}
            )
            pipe.xadd(
                keys.events(rid),
                _entry(Start(request_id=rid, model="bench", prompt_tokens=1)),
            )
        await pipe.execute()
    return rids


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_queue_seconds(pid: int) -> float:
    """Seconds a process spent runnable but waiting for a CPU (Linux schedstat, all threads):
    when this is large, the machine, not the process, is the limit."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_level(
    nodes: Nodes, port: int, api_pid: int, n: int, seconds: float, schema: int
) -> dict[str, float]:
    redis = nodes.redis
    rids = await create_requests(redis, f"n{n}", n)
    delays: list[float] = []
    gaps: list[float] = []
    go = mp.Event()
    pub_cpu, pub_events = mp.Value("d", 0.0), mp.Value("q", 0)
    args = (nodes.url, rids, seconds, go, pub_cpu, pub_events, schema, nodes.routes(rids))
    proc = mp.Process(target=publisher, args=args)
    proc.start()
    clients = []
    for rid in rids:  # connect in sequence: a burst of SYNs overflows the listen backlog
        clients.append(await open_client(port, rid, delays, gaps))
    await asyncio.wait_for(asyncio.gather(*(c.ready for c in clients)), timeout=60)
    await asyncio.sleep(0.5)  # the Start events: read (and the doorbells subscribed) first
    delays.clear()
    gaps.clear()
    go.set()
    t0, cpu0, wait0 = time.monotonic(), cpu_seconds(api_pid), run_queue_seconds(api_pid)
    own0, (redis0, commands0) = time.process_time(), await nodes.counters()
    load0 = os.getloadavg()[0]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.done for c in clients)), timeout=seconds + 20)
    except TimeoutError:
        stuck = [c.events for c in clients if not c.done.done()]
        print(
            f"{len(stuck)} of {n} streams did not finish: {stuck[:5]} events read; publisher "
            f"alive {proc.is_alive()} {pub_events.value}",
            file=sys.stderr,
        )
        raise
    elapsed = time.monotonic() - t0
    api_cpu = cpu_seconds(api_pid) - cpu0
    api_wait = run_queue_seconds(api_pid) - wait0
    own = time.process_time() - own0
    redis1, commands1 = await nodes.counters()
    rcpu = [b - a for a, b in zip(redis0, redis1, strict=True)]
    await asyncio.to_thread(proc.join)
    async with redis.pipeline(transaction=False) as pipe:
        for rid in rids:
            pipe.delete(keys.events(rid), keys.request(rid), keys.cancel(rid))
        await pipe.execute()
    return {
        "n": n,
        "cpu": api_cpu / elapsed * 100,
        "api_wait": api_wait / elapsed * 100,
        "us_per_event": api_cpu / max(1, len(delays)) * 1e6,
        "clients_cpu": own / elapsed * 100,
        "publisher_cpu": pub_cpu.value / elapsed * 100,
        "redis_cpu": sum(rcpu) / elapsed * 100,
        "redis_max": max(rcpu) / elapsed * 100,
        "commands_per_event": (commands1 - commands0) / max(1, pub_events.value),
        "load": max(load0, os.getloadavg()[0]),
        "events": len(delays),
        "published": pub_events.value,
        "rate": len(delays) / elapsed,
        "p50": pct(delays, 0.5),
        "p90": pct(delays, 0.9),
        "p99": pct(delays, 0.99),
        "gap50": pct(gaps, 0.5),
        "gap99": pct(gaps, 0.99),
        "max": max(delays, default=float("nan")),
    }


async def probe(nodes: Nodes, port: int, count: int) -> list[float]:
    """Idle path: single XADDs 10 ms apart, XADD wall time → bytes read from the API socket
    (on a cluster each XADD is followed by its doorbell, as the PUBLISH script rings it)."""
    redis = nodes.redis
    (rid,) = await create_requests(redis, "probe", 1)
    delays: list[float] = []
    client = await open_client(port, rid, delays, [])
    await client.ready

    key = keys.events(rid)
    primary = nodes.primary(key)

    async def append(event: AnyEvent) -> None:
        fields = _entry(event)
        if primary is None:
            await redis.xadd(key, fields)
            return
        entry_id = await primary.xadd(key, fields)  # then the ring, as the script does
        await primary.execute_command("SPUBLISH", key, entry_id)  # type: ignore[no-untyped-call]

    for _ in range(count):
        await asyncio.sleep(0.01)
        await append(TextDelta(text=str(time.time_ns()), token_ids=[1]))
    await append(Usage(input_tokens=1, output_tokens=count))
    await append(Finish(reason="end_turn"))
    await client.done
    await redis.delete(keys.events(rid), keys.request(rid), keys.cancel(rid))
    return delays


async def main(args: argparse.Namespace) -> None:
    SCHEMA[0] = args.schema
    # The clients' receive times are the measurement: a full collection over this process's
    # imports would stall them all at once, like the API's (services/api/main.py), and be
    # counted as the API's delay.
    gc.collect()
    gc.freeze()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    redis_proc, cluster = None, None
    queue_url = args.queue_url
    if not queue_url and (args.cluster or not args.redis_url):
        redis_proc, queue_url = start_redis(tmp)  # the events too, without a URL or --cluster
    if args.cluster:
        cluster = start_cluster(tmp)
        events_url = cluster.url
    else:
        events_url = args.redis_url or queue_url
    if redis_conn.is_cluster_url(events_url) and not queue_url:
        sys.exit("streams.py: a cluster events URL needs --queue-url (arq's single Redis)")
    queue_url = queue_url or events_url
    port = args.api_port or free_port()
    api = None if args.api_port else start_api(events_url, queue_url, port, args.api_tree)
    api_pid = api.pid if api is not None else args.api_pid
    if args.api_cpu is not None and api_pid:
        # The API on a core of its own, everything else (this process's clients, the publisher
        # it forks, a private Redis) on the rest: as a deployment would run it, not competing
        # with its own load generator for the same core.
        rest = os.sched_getaffinity(0) - {args.api_cpu}
        os.sched_setaffinity(api_pid, {args.api_cpu})
        for pid in (0, redis_proc.pid if redis_proc is not None else 0):
            os.sched_setaffinity(pid, rest)
        print(f"API pinned to CPU {args.api_cpu}; clients, publisher and Redis on {sorted(rest)}")
    nodes = Nodes(redis_conn.client(events_url), events_url)
    try:
        await nodes.discover()
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the API's lifespan (hub, cards) after the socket opens
        where = f"{len(nodes.servers)}-node cluster" if nodes.cluster else "one Redis"
        tree = args.api_tree or "this tree"
        print(f"events on {where}; API from {tree}; entries schema v{args.schema}")
        idle = await probe(nodes, port, args.probe)
        print(
            f"idle XADD → socket: median {statistics.median(idle):.2f} ms, "
            f"p90 {pct(idle, 0.9):.2f} ms, p99 {pct(idle, 0.99):.2f} ms ({len(idle)} events)\n"
        )
        print(
            "| streams | events/s | API µs CPU/event | CPU % API / clients / publisher / Redis "
            "(busiest node) | API waiting for a CPU % | Redis commands/event | load "
            "| latency p50 / p90 / p99 / max ms | added delay p50 / p99 ms | < 50 ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for n in args.levels:
            r = await run_level(nodes, port, api_pid, n, args.seconds, args.schema)
            ok = r["gap99"] < 50 and r["events"] >= r["published"]
            print(
                f"| {n} | {r['rate']:.0f} | {r['us_per_event']:.0f} | {r['cpu']:.0f} / "
                f"{r['clients_cpu']:.0f} / {r['publisher_cpu']:.0f} / {r['redis_cpu']:.0f} "
                f"({r['redis_max']:.0f}) | {r['api_wait']:.0f} | {r['commands_per_event']:.2f} "
                f"| {r['load']:.1f} "
                f"| {r['p50']:.1f} / {r['p90']:.1f} / {r['p99']:.1f} / {r['max']:.1f} "
                f"| {r['gap50']:.1f} / {r['gap99']:.1f} | {'yes' if ok else 'no'} |",
                flush=True,
            )
            if not ok and not args.keep_going:
                break
    finally:
        await nodes.close()
        await nodes.redis.aclose()
        if api is not None:
            api.send_signal(signal.SIGTERM)
            try:
                api.wait(timeout=10)
            except subprocess.TimeoutExpired:
                api.kill()
                api.wait()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--redis-url",
        "--events-url",
        default=None,
        help="use this (events) Redis instead of a private one; passed through as is",
    )
    parser.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[100, 250, 500, 1000, 1500, 2000],
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="publishing time per level")
    parser.add_argument(
        "--api-port", type=int, default=0, help="use a running API (with --redis-url)"
    )
    parser.add_argument("--api-pid", type=int, default=0, help="its pid, for the CPU column")
    parser.add_argument("--keep-going", action="store_true", help="run every level")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="events on a private 3x2 Redis Cluster on ports 17100-17105",
    )
    parser.add_argument("--queue-url", default="", help="arq's Redis (default: a private one)")
    parser.add_argument(
        "--schema", type=int, choices=(1, 2), default=2, help="entry format the publisher writes"
    )
    parser.add_argument(
        "--api-tree", type=Path, default=None, help="run the API from this checkout instead"
    )
    parser.add_argument("--probe", type=int, default=300, help="events in the idle latency probe")
    parser.add_argument(
        "--api-cpu", type=int, default=None, help="pin the API to this CPU and the rest off it"
    )
    try:  # the clients' own loop overhead is measured too: keep it as small as the API's
        import uvloop

        uvloop.run(main(parser.parse_args()))
    except ImportError:
        asyncio.run(main(parser.parse_args()))
