"""The cheap load generator of ``streams.py``: a raw-protocol publisher and raw-socket SSE clients.

Kept minimal on purpose, so that the benchmark measures the API and not its own load: the
publisher writes pipelined XADDs in the Redis protocol over a plain socket (one write and one
read per tick for every stream), and each SSE client is an ``asyncio.Protocol`` (no coroutine
per read, no HTTP library, one JSON decode per event).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import msgspec

from shared import keys
from shared.codec import encode_event, encode_events
from shared.events import AnyEvent, Finish, TextDelta, Usage

__all__ = ["SSEClient", "open_client", "publisher"]

TICK_S = 0.05  # 20 tokens/s per stream


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


def _node_socket(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _bulk(part: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(part), part)


def publisher(
    redis_url: str,
    rids: list[str],
    seconds: float,
    go: Any,
    cpu_out: Any,
    events_out: Any,
    schema: int = 2,
    routes: list[tuple[str, int, list[str]]] | None = None,
) -> None:
    """Process body playing a batching worker as cheaply as possible: every tick, one write of
    pipelined raw-protocol XADDs (one per stream, the same encoded body for all), then the
    closing entry (``Usage`` + ``Finish``). Reports its own CPU seconds through ``cpu_out``.

    ``schema`` 2 writes what workers write now (``e`` = a msgpack array of the step's events);
    1 the older one-event entries (for an API tree that predates schema 2). With ``routes``
    (a Redis Cluster: per primary ``(host, port, request ids)``), each primary gets its own
    pipeline, and every XADD is followed by the doorbell the PUBLISH script rings there
    (``SPUBLISH <stream key> <entry id>``, ``shared.protocol.DOORBELL``): the ids are explicit
    (``<ms>-0``, rising each tick) so that the ring can name the entry in the same pipeline.
    """
    cluster = routes is not None
    if routes is None:
        routes = [("", 0, rids)]
    socks = [_connect_redis(redis_url) if not cluster else _node_socket(h, p) for h, p, _ in routes]
    version = _bulk(str(schema).encode())
    stream_keys = [[keys.events(rid).encode() for rid in node_rids] for _, _, node_rids in routes]

    def body(events: list[AnyEvent]) -> list[bytes]:
        if schema == 1:
            return [encode_event(event) for event in events]
        return [encode_events(events)]

    def write(bodies: list[bytes], last_ms: int) -> int:
        """One pipeline per node of an XADD per stream per body (and its ring); returns the
        last explicit id's ms."""
        ids = []
        for _ in bodies:
            last_ms = max(last_ms + 1, time.time_ns() // 1_000_000)
            ids.append(b"%d-0" % last_ms if cluster else b"*")
        tails = [version + b"$1\r\ne\r\n" + _bulk(b) for b in bodies]
        replies = []
        for sock, node_keys in zip(socks, stream_keys, strict=True):
            out = []
            for key in node_keys:
                k = _bulk(key)
                for entry_id, tail in zip(ids, tails, strict=True):
                    out.append(b"*7\r\n$4\r\nXADD\r\n" + k + _bulk(entry_id) + b"$1\r\nv\r\n")
                    out.append(tail)
                    if cluster:
                        out.append(b"*3\r\n$8\r\nSPUBLISH\r\n" + k + _bulk(entry_id))
            sock.sendall(b"".join(out))
            replies.append(len(node_keys) * len(ids) * (2 if cluster else 1))
        for sock, n in zip(socks, replies, strict=True):
            _read_replies(sock, n)
        return last_ms

    go.wait()
    cpu0 = time.process_time()
    end = time.monotonic() + seconds
    next_tick = time.monotonic()
    count = 0
    last_ms = 0
    while time.monotonic() < end:
        last_ms = write(body([TextDelta(text=str(time.time_ns()), token_ids=[1])]), last_ms)
        count += 1
        next_tick += TICK_S
        time.sleep(max(0.0, next_tick - time.monotonic()))
    write(body([Usage(input_tokens=1, output_tokens=count), Finish(reason="end_turn")]), last_ms)
    cpu_out.value = time.process_time() - cpu0
    events_out.value = count * len(rids)
    for sock in socks:
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
