"""JSONL export and replay of event streams: ``sluice export`` and ``sluice replay``.

Owns writing a request's event log straight from Redis as JSONL (one ``StreamEvent`` per line)
and the two CLI commands built on it and on the sources in ``sluice_client.sources``. redis is
imported inside the function that uses it, so importing this module does no I/O.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import IO

import msgspec

from shared import keys
from shared.codec import decode_entry
from shared.config import Settings
from shared.errors import NotFound, ServiceError
from shared.events import is_terminal
from sluice_client.sources import EventSource, LiveSource, RecordedSource, StreamEvent, entry_ms

__all__ = ["cli_export", "cli_replay", "export_stream"]

_JSON = msgspec.json.Encoder()


async def export_stream(redis_url: str, rid: str, path: str | Path | IO[str]) -> int:
    """Write a request's event log from Redis as JSONL (one ``StreamEvent`` per line).

    Args:
        redis_url: the Redis holding the stream.
        rid: the request id.
        path: a file path, or an open text stream (e.g. ``sys.stdout``).

    Returns:
        The number of events written.

    Raises:
        NotFound: the stream does not exist (never created, or expired).
        ProtocolError: an entry does not decode.
    """
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    lines: list[bytes] = []
    try:
        start, first_ms = "-", None
        while True:
            page = await client.xrange(keys.events(rid), min=start, max="+", count=500)
            for raw_id, fields in page:
                entry_id = raw_id.decode()
                first_ms = entry_ms(entry_id) if first_ms is None else first_ms
                for event in decode_entry(fields):  # the events of one entry share its id
                    item = StreamEvent(entry_id, entry_ms(entry_id) - first_ms, event)
                    lines.append(_JSON.encode(item))
            if len(page) < 500:
                break
            start = "(" + page[-1][0].decode()
    finally:
        await client.aclose()
    if not lines:
        raise NotFound(f"no event stream for request '{rid}'")
    await asyncio.to_thread(_write, path, b"\n".join(lines).decode() + "\n")
    return len(lines)


def _write(path: str | Path | IO[str], text: str) -> None:
    if isinstance(path, str | Path):
        Path(path).write_text(text, encoding="utf-8")
    else:
        path.write(text)
        path.flush()


def cli_export(settings: Settings, rid: str, output: str) -> int:
    """``sluice export <rid> -o <file>``: export a stream as JSONL (``-`` for stdout).

    Args:
        settings: the process settings (``redis_url``).
        rid: the request id.
        output: the output path, or ``-``.

    Returns:
        0 on success, 1 when there is no such stream or Redis cannot be read.
    """
    from redis.exceptions import RedisError

    target: str | IO[str] = sys.stdout if output == "-" else output
    try:
        count = asyncio.run(export_stream(settings.redis_url, rid, target))
    except ServiceError as exc:
        print(f"sluice export: {exc.message}", file=sys.stderr)
        return 1
    except (RedisError, OSError) as exc:  # one line for the operator, not a traceback
        print(f"sluice export: cannot read Redis at {settings.redis_url}: {exc}", file=sys.stderr)
        return 1
    if output != "-":
        print(f"wrote {count} events to {output}", file=sys.stderr)
    return 0


def cli_replay(settings: Settings, source: str, realtime: bool) -> int:
    """``sluice replay <file.jsonl | request id>``: print events as JSON lines.

    A path that exists is a recording; anything else is a request id streamed from the server at
    ``settings.host:port`` (with the first configured key, or ``SLUICE_API_KEY``).

    Args:
        settings: the process settings.
        source: a JSONL file or a request id.
        realtime: keep a recording's original timing.

    Returns:
        0 when the stream ended with its terminal event, 1 otherwise.
    """
    src: EventSource
    if os.path.exists(source):
        src = RecordedSource(source, realtime=realtime)
    else:
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        key = settings.api_key or next(iter(sorted(settings.all_api_keys())), None)
        src = LiveSource(f"http://{host}:{settings.port}", key, request_id=source)

    async def run() -> bool:
        complete = False
        async for item in src.events():
            sys.stdout.write(_JSON.encode(item).decode() + "\n")
            sys.stdout.flush()
            complete = is_terminal(item.event)
        return complete

    try:
        return 0 if asyncio.run(run()) else 1
    except ServiceError as exc:
        print(f"sluice replay: {exc.message}", file=sys.stderr)
        return 1
