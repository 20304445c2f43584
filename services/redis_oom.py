"""Recognising Redis's "out of memory" refusal, and reading how close Redis is to it.

With ``maxmemory`` set and the ``noeviction`` policy, a full Redis refuses every command that
could grow its memory (``SET``, ``HSET``, ``XADD`` ...) and keeps serving reads, deletes and
``EXPIRE``. The refusal is not a failure of sluice nor of the request: it lasts until memory
is freed (streams expire, an operator raises ``maxmemory``), so the API answers it as a 503
with ``Retry-After`` and a worker holds its events and retries (``services.worker.publisher``).

redis-py raises ``OutOfMemoryError`` for a plain command. Inside a Lua script the same refusal
arrives as that error on Redis 7 (``OOM command not allowed ... script: <sha>``) and as a
``ResponseError`` wrapping it on older servers (``ERR Error running script ... -OOM command not
allowed``), so the message is matched too. Neither text may reach a client: callers replace it
with ``OOM_MESSAGE``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redis.exceptions import OutOfMemoryError, ResponseError

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["OOM_MESSAGE", "Memory", "is_oom", "read_memory"]

# What a client is told instead of Redis's own words (which name a script hash and a limit).
OOM_MESSAGE = "the event store is out of memory; retry shortly"

_MARKER = "OOM command not allowed"


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write because ``maxmemory`` is reached."""
    if isinstance(exc, OutOfMemoryError):
        return True
    return isinstance(exc, ResponseError) and _MARKER in str(exc)


class Memory:
    """``used_memory`` and ``maxmemory`` of one Redis (``max_bytes`` 0: no limit set)."""

    def __init__(self, used_bytes: int, max_bytes: int) -> None:
        """Hold the two figures from ``INFO memory``."""
        self.used_bytes = used_bytes
        self.max_bytes = max_bytes

    @property
    def ratio(self) -> float | None:
        """``used / max``, or None when Redis has no limit (it then never refuses writes)."""
        return self.used_bytes / self.max_bytes if self.max_bytes else None

    def as_json(self) -> dict[str, object]:
        """The figures as ``/readyz`` shows them."""
        ratio = self.ratio
        return {
            "used_bytes": self.used_bytes,
            "max_bytes": self.max_bytes,
            "used_ratio": None if ratio is None else round(ratio, 4),
        }


async def read_memory(redis: aioredis.Redis) -> Memory:
    """One ``INFO memory`` (a read: it answers even when Redis refuses writes).

    On a cluster redis-py answers per node; the fullest node is the one that refuses first.
    """
    info: dict[str, Any] = await redis.info("memory")
    nodes = [v for v in info.values() if isinstance(v, dict)] or [info]
    figures = [Memory(int(n.get("used_memory", 0)), int(n.get("maxmemory", 0))) for n in nodes]
    return max(figures, key=lambda m: m.ratio or 0.0)
