"""The hub's XREAD in RESP, packed here instead of by redis-py's command layer.

The hub re-issues one XREAD naming every watched stream after each reply (dozens of times a
second under load), so the command carries two arguments per stream. redis-py's
``pack_command`` encodes and frames every argument in Python on each call, and its
``execute_command`` adds a retry wrapper, a lock and a response callback around a read whose
errors the hub handles itself (``pack_command`` alone was 5-6 % of the API's CPU at 500
streams in py-spy). Here a key's RESP bulk string is built once and reused while the key is
watched; only the ids, which move, are framed per call. The reply is read with the
connection's own parser (hiredis), as nested RESP2 lists (``StreamHub._dispatch``).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.connection import Connection

__all__ = ["XRead", "raw_reply"]


def raw_reply(response: Any, **options: Any) -> Any:
    """A response callback that keeps a reply as parsed RESP2 (the cluster hub's XREADs)."""
    del options
    return response


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class XRead:
    """Packs ``XREAD COUNT c BLOCK ms STREAMS k1 … kN id1 … idN`` and reads its reply."""

    def __init__(self, count: int, block_ms: int) -> None:
        """Fix the COUNT and BLOCK arguments of every call."""
        self._options = (
            b"$5\r\nXREAD\r\n$5\r\nCOUNT\r\n"
            + _bulk(str(count).encode())
            + b"$5\r\nBLOCK\r\n"
            + _bulk(str(block_ms).encode())
            + b"$7\r\nSTREAMS\r\n"
        )
        self._keys: dict[str, bytes] = {}

    def pack(self, streams: dict[str, str]) -> bytes:
        """The command's bytes for ``streams`` (key → the id to read after)."""
        keys = self._keys
        if len(keys) > 2 * len(streams) + 64:  # keys nobody watches any more: start over
            keys.clear()
        parts = [b"*%d\r\n" % (6 + 2 * len(streams)), self._options]
        for key in streams:
            bulk = keys.get(key)
            if bulk is None:
                bulk = keys[key] = _bulk(key.encode())
            parts.append(bulk)
        for cursor in streams.values():
            parts.append(_bulk(cursor.encode()))
        return b"".join(parts)

    async def call(self, connection: Connection, streams: dict[str, str]) -> Any:
        """Send the XREAD and return its raw reply (None when the block timed out).

        Raises:
            ResponseError: Redis refused the call (e.g. a key is not a stream).
            ConnectionError, TimeoutError, OSError: the connection failed; redis-py has
                disconnected it and the next call reconnects.
        """
        await connection.send_packed_command(self.pack(streams), check_health=False)
        return await connection.read_response()
