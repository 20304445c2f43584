"""Appending a request's events to its Redis stream, fenced by the request lease.

The publisher owns the write side of ``sluice:events:{rid}``: every batch (what one decode step
produced) goes out in one round trip as one Lua script that (1) checks that this worker still
holds ``sluice:lease:{rid}`` (re-taking it if it merely expired), (2) XADDs each envelope with
``MAXLEN ~ stream_maxlen``, (3) refreshes the stream's TTL to the retention, and (4) returns whether
``sluice:cancel:{rid}`` is set. Doing this atomically is what keeps the stream a clean log when a
stalled worker wakes up after another worker took its request over: its late batch is refused
instead of interleaving (fencing). Checking the cancel flag in the same call costs one O(1)
command per step and no extra round trip, and bounds cancellation latency to one decode step.

It also tracks the terminal event, so exactly one ``Finish``/``Error`` ever reaches the stream
(``ensure_terminal`` is the ``finally`` that guarantees one). All three keys share the ``{rid}``
hash tag, so the script is valid on Redis Cluster too.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from shared import keys
from shared.codec import SCHEMA_VERSION, encode_event
from shared.config import Settings
from shared.events import AnyEvent, is_terminal

__all__ = ["ACQUIRE", "REFRESH", "RELEASE", "LuaScript", "Outcome", "Publisher"]

log = logging.getLogger(__name__)


class LuaScript:
    """A Lua script called by SHA with a fallback to loading it (e.g. after a Redis restart)."""

    def __init__(self, source: str) -> None:
        """Keep the source and its SHA1."""
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(
        self, client: aioredis.Redis, keys_: Sequence[str], args: Sequence[str | bytes | int]
    ) -> Any:
        """Run the script once (EVALSHA, or LOAD then EVALSHA if the server lacks it)."""
        untyped: Any = client  # redis-py's stubs type every EVALSHA argument as str
        try:
            return await untyped.evalsha(self.sha, len(keys_), *keys_, *args)
        except NoScriptError:
            await self.load(client)
            return await untyped.evalsha(self.sha, len(keys_), *keys_, *args)

    def queue(self, pipe: Any, keys_: Sequence[str], args: Sequence[str | bytes | int]) -> None:
        """Queue an EVALSHA on a pipeline (load the script beforehand with ``load``)."""
        pipe.evalsha(self.sha, len(keys_), *keys_, *args)

    async def load(self, client: aioredis.Redis) -> None:
        """SCRIPT LOAD the source."""
        await client.script_load(self.source)


# KEYS: events, lease, cancel. ARGV: owner, lease_ttl_ms, maxlen, retention_s, version, body...
# Returns -1 when another owner holds the lease (nothing written), else EXISTS cancel.
PUBLISH = LuaScript(
    """
local holder = redis.call('GET', KEYS[2])
if not holder then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
elseif holder ~= ARGV[1] then
  return -1
end
for i = 6, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'v', ARGV[5], 'e', ARGV[i])
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return redis.call('EXISTS', KEYS[3])
"""
)

# KEYS: lease. ARGV: owner, ttl_ms. Take the lease unless a live worker holds it; a
# "recovering:" claim (a sweeper handing the request to whichever worker starts it) yields.
ACQUIRE = LuaScript(
    """
local holder = redis.call('GET', KEYS[1])
if (not holder) or holder == ARGV[1] or string.sub(holder, 1, 11) == 'recovering:' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
)

# KEYS: lease, cancel. ARGV: owner, ttl_ms. -1 = lost to another owner, else EXISTS cancel.
REFRESH = LuaScript(
    """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  return -1
end
return redis.call('EXISTS', KEYS[2])
"""
)

# KEYS: lease. ARGV: owner. Delete the lease only if we still hold it.
RELEASE = LuaScript(
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
)


class Outcome(enum.Enum):
    """What a publish call learned besides "written"."""

    OK = "ok"
    CANCELLED = "cancelled"  # written, and the cancel flag is set: stop after this step
    LEASE_LOST = "lease_lost"  # not written: another worker owns the request now


class Publisher:
    """Writes one request's events; one instance per (request, attempt).

    ``owner`` is the lease value this publisher writes under (the worker id, or a sweeper's
    ``recovering:<wid>`` claim when it ends a request it could not hand over).
    """

    def __init__(self, redis: aioredis.Redis, rid: str, owner: str, settings: Settings) -> None:
        """Bind to the request's keys."""
        self.redis = redis
        self.rid = rid
        self.owner = owner
        self._keys = (keys.events(rid), keys.lease(rid), keys.cancel(rid))
        self._head: tuple[str | int, ...] = (
            owner,
            int(settings.lease_ttl_s * 1000),
            settings.stream_maxlen,
            settings.retention_s,
            SCHEMA_VERSION,
        )
        self.terminal: AnyEvent | None = None
        self.lease_lost = False
        self.published = 0

    async def publish(self, events: Sequence[AnyEvent]) -> Outcome:
        """Append ``events`` (one step's worth) in one round trip.

        Cancellation waits for a call already sent, so ``terminal`` always tells the truth about
        the stream (a shutdown that interrupted a terminal write must not add a second one).

        Raises:
            RuntimeError: a terminal event was already published (a caller bug).
        """
        if self.terminal is not None:
            raise RuntimeError(f"{self.rid}: publish after the terminal event")
        if self.lease_lost:
            return Outcome.LEASE_LOST
        write = asyncio.ensure_future(self._write(events))
        try:
            return await asyncio.shield(write)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await write
            raise

    async def _write(self, events: Sequence[AnyEvent]) -> Outcome:
        bodies = [encode_event(e) for e in events]
        result = int(await PUBLISH(self.redis, self._keys, [*self._head, *bodies]))
        if result < 0:
            self.lease_lost = True
            log.warning("%s: lease taken over by another worker; stopping", self.rid)
            return Outcome.LEASE_LOST
        self.published += len(events)
        terminals = [e for e in events if is_terminal(e)]
        if terminals:
            self.terminal = terminals[-1]
        return Outcome.CANCELLED if result == 1 else Outcome.OK

    async def ensure_terminal(self, make: Callable[[], Sequence[AnyEvent]]) -> bool:
        """Publish ``make()`` unless a terminal is out or the lease is lost; True if published."""
        if self.terminal is not None or self.lease_lost:
            return False
        await self.publish(make())
        return self.terminal is not None

    async def acquire(self) -> bool:
        """Take the lease for this owner (False: another live worker holds it)."""
        return bool(await ACQUIRE(self.redis, self._keys[1:2], self._head[:2]))

    def queue_acquire(self, pipe: Any) -> None:
        """Queue ``acquire`` on a pipeline (its reply is 1 when taken); ACQUIRE must be loaded."""
        ACQUIRE.queue(pipe, self._keys[1:2], self._head[:2])

    async def release(self) -> None:
        """Drop the lease if this owner still holds it."""
        await RELEASE(self.redis, self._keys[1:2], [self.owner])
