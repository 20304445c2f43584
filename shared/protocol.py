"""The Redis protocol between the API and the workers: who may write a request's event stream.

Both services speak it, so it lives here with the keys (``shared.keys``): the values a request
lease can hold, and the Lua scripts that move the lease (the queue's own protocol is
``services.queue``'s). Each script
touches only one request's keys, which share the ``{rid}`` hash tag, so all of them are valid on
Redis Cluster too.

The lease
---------
``sluice:lease:{rid}`` names the one writer allowed to append to ``sluice:events:{rid}``. It
holds one of:

- nothing: nobody is generating the request. Either it still waits in the arq queue, or the
  worker that had it stopped refreshing the lease (crashed, killed, partitioned).
- ``<wid>``, a worker id: that worker generates the request. TTL ``lease_ttl_s``, refreshed
  by its heartbeat every ``heartbeat_s`` (``refresh``) and by every publish.
- ``recovering:<wid>``: the sweeper of worker ``wid`` found the request without a lease and
  enqueued a continuation (``claim_lost``); whichever worker starts the continuation takes the
  lease over (``acquire``). The sweeper also writes under this value when it ends the request
  with ``Error(worker_lost)`` instead.
- ``api-timeout``: the API ended a request no worker started within ``start_timeout_s``
  (``claim_unstarted``). Held for ``retention_s``, longer than anyone reads the stream, and no
  script hands it over, so a late worker never writes after the ``Error``.

Transitions, each one atomic (one script or one ``SET NX``):

=========================  =====================  =============================================
from                       to                     by
=========================  =====================  =============================================
nothing                    ``<wid>``              ``acquire`` at job start; ``publish`` and
                                                  ``refresh`` re-take their own expired lease
``recovering:*``           ``<wid>``              ``acquire`` (the continuation starts)
``<wid>``                  nothing                ``release`` by the holder, or expiry
nothing                    ``recovering:<wid>``   ``claim_lost`` (``SET NX``)
nothing, empty stream      ``api-timeout``        ``claim_unstarted`` (appends the Error too)
=========================  =====================  =============================================

Any other holder fences the caller out: ``acquire`` returns 0, ``publish`` and ``refresh``
return ``LEASE_LOST`` and write nothing. That is what keeps the stream a clean log when a
stalled worker wakes up after its request moved on.

Stream entries are ``XADD sluice:events:{rid} MAXLEN ~ <maxlen> * v <schema version> e <msgpack
array of events>`` (one entry per sequence per decode step, ``shared.codec``), and the writer
keeps the stream's TTL at the retention (set on its first write and its terminal one, refreshed
between at most once a minute).

Running the scripts
-------------------
``Scripts(redis)`` registers them on a client with redis-py's ``register_script``: a call is an
EVALSHA, and on NOSCRIPT (a restarted Redis forgot its script cache) a SCRIPT LOAD and the same
EVALSHA again. A script queued on a pipeline (``queue_acquire``, ``queue_refresh``) is loaded by
the pipeline itself before it sends its commands (SCRIPT EXISTS, then SCRIPT LOAD for any the
server lacks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared import keys
from shared.codec import SCHEMA_VERSION

if TYPE_CHECKING:  # calls go through the caller's client; importing redis reads its metadata
    import redis.asyncio as aioredis
    from redis.asyncio.client import Pipeline

__all__ = [
    "ACQUIRE",
    "API_TIMEOUT_OWNER",
    "CLAIM_UNSTARTED",
    "DOORBELL",
    "LEASE_LOST",
    "PUBLISH",
    "RECOVERING",
    "REFRESH",
    "RELEASE",
    "Claim",
    "Scripts",
    "claim_lost",
    "recovering_owner",
    "ringing",
]


RECOVERING = "recovering:"  # lease value prefix while a continuation waits for a worker
API_TIMEOUT_OWNER = "api-timeout"  # the lease value of a timed-out request: never handed over

LEASE_LOST = -1  # ``publish`` / ``refresh``: another owner holds the lease, nothing was written


def recovering_owner(wid: str) -> str:
    """The lease value a sweeper on worker ``wid`` claims a lost request under."""
    return f"{RECOVERING}{wid}"


PUBLISH = """
local state = redis.call('MGET', KEYS[2], KEYS[3])
if not state[1] then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
elseif state[1] ~= ARGV[1] then
  return -1
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'v', ARGV[5], 'e', ARGV[6])
if ARGV[4] ~= '0' then
  for k = 1, #KEYS do
    if k ~= 2 and k ~= 3 then redis.call('EXPIRE', KEYS[k], ARGV[4]) end
  end
end
local cancelled = 0
if state[2] then cancelled = 1 end
return cancelled
"""
"""Append one entry (a decode step's events) under the lease, and read the cancel flag.

KEYS: events, lease, cancel, then any keys whose TTL becomes ``retention_s`` with the stream's
(the request hash of a ``store: false`` request's terminal batch: shortened in the same step as
the terminal event is written, so no crash can leave it at the full retention). ARGV: owner,
lease_ttl_ms, maxlen, retention_s (``0``: leave the TTLs as they are), schema version, the
entry's body (``shared.codec.encode_events``). Takes the lease if it is free (the owner's own
lease expired during a slow step), refuses if another owner holds it. Returns ``LEASE_LOST``
(-1, nothing written), else 1 when the cancel flag is set and 0 when not.

Commands per call: the EVALSHA, one MGET (lease and cancel flag together: both keys share the
``{rid}`` tag, so this is valid on a cluster too), the XADD, and EXPIREs only when the caller
asks (``Publisher`` does on its first and terminal writes and once a minute between: a TTL of
hours need not be re-set on every token). That is 3 commands per entry, down from 5.
"""

ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if (not holder) or holder == ARGV[1] or string.sub(holder, 1, 11) == 'recovering:' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
"""Take the lease at job start.

KEYS: lease. ARGV: owner, lease_ttl_ms. Takes it when free, already ours, or a ``recovering:``
claim (a sweeper handing the request to whichever worker starts it; 11 is ``len(RECOVERING)``).
Returns 1 when taken, 0 when a live worker or ``api-timeout`` holds it.
"""

REFRESH = """
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
"""The heartbeat's lease refresh, which reads the cancel flag too.

KEYS: lease, cancel. ARGV: owner, lease_ttl_ms. Extends the lease if ours, re-takes it if it
expired. Returns ``LEASE_LOST`` (-1) when another owner holds it, else 1 when the cancel flag is
set and 0 when not.
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
"""Drop the lease, only if we still hold it.

KEYS: lease. ARGV: owner. Returns 1 when deleted, 0 when it was not ours (or gone).
"""

CLAIM_UNSTARTED = """
if redis.call('XLEN', KEYS[1]) > 0 then
  return 0
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  return -2
end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return -1
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'v', ARGV[5], 'e', ARGV[6])
if redis.call('HGET', KEYS[3], 'store') == '0' then
  redis.call('EXPIRE', KEYS[1], ARGV[7])
  redis.call('EXPIRE', KEYS[3], ARGV[7])
else
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
return 1
"""
"""The API ends a request no worker started: the start timeout.

KEYS: events, lease, request. ARGV: owner, lease_ttl_ms, maxlen, retention_s, schema version, the
entry body holding the Error (``encode_events``), unstored_retention_s (the TTL of the stream and
the request hash when the hash says ``store`` = ``0``). Returns a ``Claim`` value: ``STARTED`` when
the stream already has an event, ``GONE`` when the request hash is gone (retention expired: nothing
to end), ``HELD`` when someone holds the lease, ``TIMED_OUT`` when the Error was appended under the
new lease.
"""


class Claim:
    """``claim_unstarted``'s answers (plain ints: the script's return values)."""

    STARTED = 0  # the stream has events: a worker started it
    HELD = -1  # a worker (or a recovery claim) holds the lease: it is about to start
    GONE = -2  # no request hash (expired or never stored): nothing to end
    TIMED_OUT = 1  # the Error is on the stream; the request is over


async def claim_lost(redis: aioredis.Redis, rid: str, wid: str, lease_ms: int) -> str | None:
    """Claim a request whose lease is gone for a recovery by worker ``wid`` (``SET NX``).

    Returns:
        The lease value now held (``recovering:<wid>``), or None when another sweeper or a
        reviving worker got there first.
    """
    owner = recovering_owner(wid)
    taken = await redis.set(keys.lease(rid), owner, nx=True, px=lease_ms)
    return owner if taken else None


DOORBELL = """
local tail = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if tail[1] then redis.call('SPUBLISH', KEYS[1], tail[1][1]) end
"""
"""On a Redis Cluster, a script that appended to ``KEYS[1]`` (the event stream) also rings its
doorbell: ``SPUBLISH`` on the shard channel named like the stream (same slot), with the id of
the stream's newest entry. One XREAD cannot block on streams in different slots (CROSSSLOT), so
the API's cluster hub listens for these instead and then reads the stream; the id tells it how
far a replica it reads from must have caught up (``services.api.cluster_hub``)."""


def ringing(script: str) -> str:
    """``script`` with ``DOORBELL`` run just before its last ``return`` (after its XADD).

    So a script that appends must end in its one ``return`` after the write: an earlier return
    past the XADD would skip the bell (the hub would see the entry only at its periodic sweep).
    """
    head, sep, tail = script.rpartition("\nreturn ")
    return head + DOORBELL + sep.lstrip("\n") + tail


def _on_cluster(redis: object) -> bool:
    # Duck-typed: shared does not import redis at module level (only RedisCluster has this).
    return hasattr(redis, "nodes_manager")


class Scripts:
    """The protocol's scripts registered on one client (cheap: one SHA1 per script).

    Each method spells the script's KEYS and ARGV from a request id, so callers never build them.
    On a Redis Cluster the scripts that append events ring the doorbell (``DOORBELL``), and a
    script queued on a pipeline is sent whole (EVAL): a cluster pipeline does not load scripts,
    and a promoted replica's script cache is empty.
    """

    def __init__(self, redis: aioredis.Redis) -> None:
        """Register every script on ``redis``."""
        self._cluster = _on_cluster(redis)
        bell = ringing if self._cluster else str
        self._publish = redis.register_script(bell(PUBLISH))
        self._acquire = redis.register_script(ACQUIRE)
        self._refresh = redis.register_script(REFRESH)
        self._release = redis.register_script(RELEASE)
        self._claim_unstarted = redis.register_script(bell(CLAIM_UNSTARTED))

    async def publish(self, keys_: list[str], args: list[Any]) -> int:
        """Run ``PUBLISH`` with the KEYS and ARGV of ``publish_call``: ``LEASE_LOST``, else the
        cancel flag (0 or 1)."""
        return int(await self._publish(keys_, args))

    @property
    def publish_source(self) -> str:
        """The ``PUBLISH`` script as this client runs it (with the doorbell on a cluster)."""
        return str(self._publish.script)

    @staticmethod
    def publish_call(
        rid: str,
        owner: str,
        body: bytes,
        *,
        lease_ms: int,
        maxlen: int,
        retention_s: int,
        also_expire: Sequence[str] = (),
    ) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV of ``PUBLISH`` appending one entry ``body`` (for ``publish``, or a
        caller that pipelines them).

        ``retention_s``: the TTL the stream gets, or 0 to leave it. ``also_expire``: keys of the
        same request whose TTL becomes ``retention_s`` with the stream's (only when the script
        writes and ``retention_s`` is not 0).
        """
        keys_ = [keys.events(rid), keys.lease(rid), keys.cancel(rid), *also_expire]
        return keys_, [owner, lease_ms, maxlen, retention_s, SCHEMA_VERSION, body]

    async def acquire(self, rid: str, owner: str, lease_ms: int) -> bool:
        """Run ``ACQUIRE``: whether ``owner`` holds the lease now."""
        return bool(await self._acquire([keys.lease(rid)], [owner, lease_ms]))

    async def queue_acquire(self, pipe: Pipeline, rid: str, owner: str, lease_ms: int) -> None:
        """Queue ``ACQUIRE`` on ``pipe`` (its reply: 1 when taken, 0 when not)."""
        if self._cluster:
            pipe.eval(ACQUIRE, 1, keys.lease(rid), owner, str(lease_ms))
            return
        await self._acquire([keys.lease(rid)], [owner, lease_ms], client=pipe)

    async def queue_refresh(self, pipe: Pipeline, rid: str, owner: str, lease_ms: int) -> None:
        """Queue ``REFRESH`` on ``pipe`` (its reply: ``LEASE_LOST``, else the cancel flag)."""
        if self._cluster:
            pipe.eval(REFRESH, 2, keys.lease(rid), keys.cancel(rid), owner, str(lease_ms))
            return
        await self._refresh([keys.lease(rid), keys.cancel(rid)], [owner, lease_ms], client=pipe)

    async def release(self, rid: str, owner: str) -> bool:
        """Run ``RELEASE``: whether the lease was ours and is gone now."""
        return bool(await self._release([keys.lease(rid)], [owner]))

    async def claim_unstarted(
        self,
        rid: str,
        body: bytes,
        *,
        lease_ms: int,
        maxlen: int,
        retention_s: int,
        unstored_retention_s: int,
    ) -> int:
        """Run ``CLAIM_UNSTARTED`` as ``api-timeout`` with the Error ``body``: a ``Claim``."""
        keys_ = [keys.events(rid), keys.lease(rid), keys.request(rid)]
        args: list[Any] = [API_TIMEOUT_OWNER, lease_ms, maxlen, retention_s, SCHEMA_VERSION, body]
        args.append(unstored_retention_s)
        return int(await self._claim_unstarted(keys_, args))
