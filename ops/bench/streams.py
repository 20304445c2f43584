"""API streaming benchmark: concurrent SSE streams per API process, and XADD → socket latency.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python ops/bench/streams.py                          # private redis-server
    .venv/bin/python ops/bench/streams.py --levels 250,500,1000,1500 --seconds 8

It starts one real ``sluice api`` process and, per level N, a publisher process that plays the
worker: N request streams, one ``TextDelta`` per stream every 50 ms (20 tokens/s), all streams
of a tick in one pipeline (as a batching worker publishes one decode step), each event carrying
the wall-clock time its XADD pipeline was sent. N raw-socket SSE clients in this process read
``GET /v1/requests/{id}/events`` and record, per event, ``receive time - XADD time`` (latency:
Redis hop, hub fan-out, projection, SSE write, loopback, and the clients' own loop) and the
added inter-event delay (how much later than its predecessor an event arrived, beyond the
50 ms the publisher put between them). A level passes when the added inter-event delay's p99 is
under 50 ms; the run stops at the first failing level unless ``--keep-going``.

A separate probe measures the idle-path latency: one stream, single XADDs 10 ms apart, time
taken immediately before each XADD, median/p90/p99 of XADD → bytes read from the API socket.

Request hashes are written directly (owner "", no arq job): nothing but the API's streaming path
is measured. Not a test: it prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import msgspec
import redis.asyncio as aioredis

from shared import keys
from shared.codec import encode_entry, encode_event, encode_job
from shared.events import AnyEvent, Finish, Start, TextDelta, Usage
from shared.jobs import GenerateRequest

TICK_S = 0.05  # 20 tokens/s per stream
_JSON = msgspec.json.Decoder()


def _entry(event: AnyEvent) -> dict[Any, Any]:
    """Stream entry fields (typed loosely: redis-py's xadd wants an invariant dict type)."""
    return dict(encode_entry(event))


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server on a unix socket (no persistence)."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        sys.exit("streams.py: no redis-server on PATH; pass --redis-url")
    sock = tmp / "redis.sock"
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxclients",
            "20000",
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        if sock.exists():
            break
        time.sleep(0.01)
    return proc, f"unix://{sock}"


def start_api(redis_url: str, port: int) -> subprocess.Popen[bytes]:
    """``sluice api`` as its own process (uvicorn, uvloop/httptools when installed)."""
    env = {
        **os.environ,
        "SLUICE_REDIS_URL": redis_url,
        "SLUICE_PORT": str(port),
        "SLUICE_LOG_LEVEL": "warning",
        "SLUICE_KEEPALIVE_S": "15",
    }
    return subprocess.Popen([sys.executable, "-m", "services.cli", "api"], env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def create_requests(redis: aioredis.Redis, prefix: str, n: int) -> list[str]:
    """Request hashes as ``submit`` stores them (the API checks ownership before streaming)."""
    rids = [f"req_{prefix}_{i:05d}" for i in range(n)]
    async with redis.pipeline(transaction=False) as pipe:
        for rid in rids:
            job = GenerateRequest(request_id=rid, model="bench", created=time.time())
            pipe.hset(
                keys.request(rid), mapping={"owner": "", "model": "bench", "job": encode_job(job)}
            )
            pipe.xadd(
                keys.events(rid),
                _entry(Start(request_id=rid, model="bench", prompt_tokens=1)),
            )
        await pipe.execute()
    return rids


def _connect_redis(redis_url: str) -> socket.socket:
    """A plain blocking socket to Redis (``unix:///path[?db=n]`` or ``redis://host:port/db``)."""
    url = urlsplit(redis_url)
    db = parse_qs(url.query).get("db", ["0"])[0]
    if url.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(url.path)
    else:
        sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        db = url.path.strip("/") or db
    if db != "0":
        sock.sendall(_resp(b"SELECT", db.encode()))
        _read_replies(sock, 1)
    return sock


def _resp(*parts: bytes) -> bytes:
    """One command in the Redis protocol."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def _read_replies(sock: socket.socket, n: int) -> None:
    """Consume ``n`` simple or bulk-string replies (XADD ids, +OK); an error reply aborts."""
    buf = b""
    seen = 0
    while seen < n:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("redis closed the connection")
        buf += chunk
        while True:
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                break
            head = buf[:1]
            if head == b"-":
                raise RuntimeError(buf[:line_end].decode())
            if head == b"$":
                size = int(buf[1:line_end])
                total = line_end + 2 + size + 2
                if len(buf) < total:
                    break
                buf = buf[total:]
            else:
                buf = buf[line_end + 2 :]
            seen += 1


def publisher(
    redis_url: str, rids: list[str], seconds: float, go: Any, cpu_out: Any, events_out: Any
) -> None:
    """Process body playing a batching worker as cheaply as possible: every tick, one write of
    pipelined raw-protocol XADDs (one per stream, the same encoded body for all), then Usage +
    Finish. Reports its own CPU seconds through ``cpu_out``."""
    sock = _connect_redis(redis_url)
    heads = [
        b"*7\r\n$4\r\nXADD\r\n$%d\r\n%s\r\n$1\r\n*\r\n$1\r\nv\r\n$1\r\n1\r\n$1\r\ne\r\n"
        % (len(k), k)
        for k in (keys.events(rid).encode() for rid in rids)
    ]
    go.wait()
    cpu0 = time.process_time()
    end = time.monotonic() + seconds
    next_tick = time.monotonic()
    count = 0
    while time.monotonic() < end:
        body = encode_event(TextDelta(text=str(time.time_ns()), token_ids=[1]))
        tail = b"$%d\r\n%s\r\n" % (len(body), body)
        sock.sendall(b"".join([head + tail for head in heads]))
        _read_replies(sock, len(heads))
        count += 1
        next_tick += TICK_S
        time.sleep(max(0.0, next_tick - time.monotonic()))
    closing = [
        encode_event(Usage(input_tokens=1, output_tokens=count)),
        encode_event(Finish(reason="end_turn")),
    ]
    sock.sendall(b"".join(head + b"$%d\r\n%s\r\n" % (len(b), b) for head in heads for b in closing))
    _read_replies(sock, 2 * len(heads))
    cpu_out.value = time.process_time() - cpu0
    events_out.value = count * len(heads)
    sock.close()


class _Ev(msgspec.Struct):
    """The two fields of a native SSE event the clients look at (the rest is skipped)."""

    type: str
    text: str = ""


_EV = msgspec.json.Decoder(_Ev)


class SSEClient(asyncio.Protocol):
    """One raw-socket SSE reader: no coroutine per read, no HTTP library, one decode per event.

    Appends ``receive - XADD`` (ms) per text event to ``delays`` and the added inter-event delay
    (how much later than its predecessor an event arrived, beyond the gap the publisher put
    between them) to ``gaps``.
    """

    def __init__(self, rid: str, delays: list[float], gaps: list[float]) -> None:
        """Bind the shared result lists; ``ready``/``done`` are set by the loop callbacks."""
        loop = asyncio.get_running_loop()
        self.rid = rid
        self.delays = delays
        self.gaps = gaps
        self.ready: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[int] = loop.create_future()
        self.events = 0
        self._last: float | None = None
        self._buf = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._transport.write(
            f"GET /v1/requests/{self.rid}/events HTTP/1.1\r\nHost: b\r\n\r\n".encode()
        )

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        if not self.ready.done():
            self.ready.set_result(None)
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            event = _EV.decode(line[6:])
            self.events += 1
            if event.type == "text":
                delay = (now - int(event.text)) / 1e6
                if self._last is not None:
                    self.gaps.append(delay - self._last)
                self._last = delay
                self.delays.append(delay)
            elif event.type in ("finish", "error") and not self.done.done():
                self.done.set_result(self.events)
                assert self._transport is not None
                self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_result(None)
        if not self.done.done():
            self.done.set_result(self.events)


async def open_client(port: int, rid: str, delays: list[float], gaps: list[float]) -> SSEClient:
    """Connect one ``SSEClient`` to the API."""
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(
        lambda: SSEClient(rid, delays, gaps), "127.0.0.1", port
    )
    return client


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def redis_cpu(redis: aioredis.Redis) -> float:
    """CPU seconds the Redis server has used (user + system)."""
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_level(
    redis: aioredis.Redis, redis_url: str, port: int, api_pid: int, n: int, seconds: float
) -> dict[str, float]:
    rids = await create_requests(redis, f"n{n}", n)
    delays: list[float] = []
    gaps: list[float] = []
    go = mp.Event()
    pub_cpu, pub_events = mp.Value("d", 0.0), mp.Value("q", 0)
    proc = mp.Process(target=publisher, args=(redis_url, rids, seconds, go, pub_cpu, pub_events))
    proc.start()
    clients = []
    for rid in rids:  # connect in sequence: a burst of SYNs overflows the listen backlog
        clients.append(await open_client(port, rid, delays, gaps))
    await asyncio.wait_for(asyncio.gather(*(c.ready for c in clients)), timeout=60)
    delays.clear()  # the Start events, read before the clock starts
    go.set()
    t0, cpu0 = time.monotonic(), cpu_seconds(api_pid)
    own0, redis0 = time.process_time(), await redis_cpu(redis)
    await asyncio.wait_for(asyncio.gather(*(c.done for c in clients)), timeout=seconds + 60)
    elapsed = time.monotonic() - t0
    api_cpu = cpu_seconds(api_pid) - cpu0
    own = time.process_time() - own0
    rcpu = await redis_cpu(redis) - redis0
    await asyncio.to_thread(proc.join)
    async with redis.pipeline(transaction=False) as pipe:
        for rid in rids:
            pipe.delete(keys.events(rid), keys.request(rid), keys.cancel(rid))
        await pipe.execute()
    return {
        "n": n,
        "cpu": api_cpu / elapsed * 100,
        "us_per_event": api_cpu / max(1, len(delays)) * 1e6,
        "clients_cpu": own / elapsed * 100,
        "publisher_cpu": pub_cpu.value / elapsed * 100,
        "redis_cpu": rcpu / elapsed * 100,
        "events": len(delays),
        "published": pub_events.value,
        "rate": len(delays) / elapsed,
        "p50": pct(delays, 0.5),
        "p90": pct(delays, 0.9),
        "p99": pct(delays, 0.99),
        "gap99": pct(gaps, 0.99),
        "max": max(delays, default=float("nan")),
    }


async def probe(redis: aioredis.Redis, port: int, count: int) -> list[float]:
    """Idle path: single XADDs 10 ms apart, XADD wall time → bytes read from the API socket."""
    (rid,) = await create_requests(redis, "probe", 1)
    delays: list[float] = []
    client = await open_client(port, rid, delays, [])
    await client.ready
    for _ in range(count):
        await asyncio.sleep(0.01)
        stamp = time.time_ns()
        await redis.xadd(keys.events(rid), _entry(TextDelta(text=str(stamp), token_ids=[1])))
    await redis.xadd(keys.events(rid), _entry(Usage(input_tokens=1, output_tokens=count)))
    await redis.xadd(keys.events(rid), _entry(Finish(reason="end_turn")))
    await client.done
    return delays


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    redis_proc = None
    if args.redis_url:
        redis_url = args.redis_url
    else:
        redis_proc, redis_url = start_redis(tmp)
    port = args.api_port or free_port()
    api = start_api(redis_url, port) if not args.api_port else None
    api_pid = api.pid if api is not None else args.api_pid
    redis = aioredis.Redis.from_url(redis_url)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        idle = await probe(redis, port, args.probe)
        print(
            f"idle XADD → socket: median {statistics.median(idle):.2f} ms, "
            f"p90 {pct(idle, 0.9):.2f} ms, p99 {pct(idle, 0.99):.2f} ms ({len(idle)} events)\n"
        )
        print(
            "| streams | events/s | API µs CPU/event | CPU % API / clients / publisher / Redis "
            "| latency p50 / p90 / p99 / max ms | added inter-event delay p99 ms | < 50 ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for n in args.levels:
            r = await run_level(redis, redis_url, port, api_pid, n, args.seconds)
            ok = r["gap99"] < 50 and r["events"] >= r["published"]
            print(
                f"| {n} | {r['rate']:.0f} | {r['us_per_event']:.0f} | {r['cpu']:.0f} / "
                f"{r['clients_cpu']:.0f} / {r['publisher_cpu']:.0f} / {r['redis_cpu']:.0f} "
                f"| {r['p50']:.1f} / {r['p90']:.1f} / {r['p99']:.1f} / {r['max']:.1f} "
                f"| {r['gap99']:.1f} | {'yes' if ok else 'no'} |",
                flush=True,
            )
            if not ok and not args.keep_going:
                break
    finally:
        await redis.aclose()
        if api is not None:
            api.send_signal(signal.SIGTERM)
            api.wait(timeout=10)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of a private one")
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
    parser.add_argument("--probe", type=int, default=300, help="events in the idle latency probe")
    try:  # the clients' own loop overhead is measured too: keep it as small as the API's
        import uvloop

        uvloop.run(main(parser.parse_args()))
    except ImportError:
        asyncio.run(main(parser.parse_args()))
