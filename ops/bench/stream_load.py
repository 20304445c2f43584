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
from shared.codec import encode_event
from shared.events import Finish, TextDelta, Usage

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
