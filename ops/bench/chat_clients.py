"""Streaming Chat Completions clients that cost far less than the API they load: raw HTTP/1.1
over asyncio streams (uvloop where installed), one JSON decode per event, no HTTP library.

``client_child`` is a process body for ``multiprocessing``: it reports ready, waits for a
shared ``go`` event so that every process starts at once, then runs its streams and puts one
record per stream: the send time, ``(arrival, words)`` of each content chunk (a benchmark model
whose every token decodes to one word makes that the token count), the end time and the usage.
Times are ``time.monotonic()``, one clock for every process of the host.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["client_child", "request", "streams"]


def request(prompt: str, model: str, tokens: int) -> bytes:
    """A streamed, greedy, EOS-ignoring Chat Completion of ``tokens`` tokens, as sent."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
    )


async def _body(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The response body as it arrives, HTTP/1.1's chunked framing undone."""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = (await reader.readexactly(size + 2))[:-2] if size else b""
        else:
            data = await reader.read(1 << 16)
        if not data:
            return
        yield data


def _event(raw: bytes, now: float, out: dict[str, Any]) -> None:
    """One ``data:`` line of a Chat Completions stream, into ``out``."""
    if raw.startswith(b"data: [DONE]"):
        out["end"] = now
        return
    chunk = json.loads(raw[6:])
    if chunk.get("error"):
        out["error"] = str(chunk["error"])
    out["usage"] = chunk.get("usage") or out.get("usage")
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content")
        if text:  # every token decodes to one word
            out["chunks"].append((now, len(text.split())))


async def _stream(port: int, payload: bytes) -> dict[str, Any]:
    """One streamed request's record."""
    out: dict[str, Any] = {"chunks": []}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    out["sent"] = time.monotonic()
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        out["error"] = (head + await reader.read(2000)).decode(errors="replace")
    buf = b""
    async for data in _body(reader, b"transfer-encoding: chunked" in head.lower()):
        now = time.monotonic()
        *lines, buf = (buf + data).split(b"\n")
        for raw in lines:
            if raw.startswith(b"data: "):
                _event(raw, now, out)
    out.setdefault("end", time.monotonic())
    writer.close()
    return out


async def streams(
    jobs: list[tuple[int, str]], model: str, tokens: int, timeout_s: float
) -> list[dict[str, Any]]:
    """One request per ``(port, prompt)`` on 127.0.0.1, all at once; a failure is a record
    with ``error``."""

    async def guarded(port: int, prompt: str) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(_stream(port, request(prompt, model, tokens)), timeout_s)
        except Exception as exc:
            return {"error": repr(exc), "chunks": []}

    return list(await asyncio.gather(*(guarded(port, prompt) for port, prompt in jobs)))


def client_child(jobs: list[tuple[int, str]], kw: dict[str, Any], go: Any, results: Any) -> None:
    """Child process: report ready, wait for ``go``, run the streams, put their records."""
    results.put(("ready", []))
    go.wait()
    run: Any = asyncio.run
    try:
        import uvloop

        run = getattr(uvloop, "run", run)  # uvloop >= 0.18
    except ImportError:
        pass
    results.put(("done", run(streams(jobs, **kw))))
