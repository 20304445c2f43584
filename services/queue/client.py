"""``Queue``: one model queue's operations for the API, the sweepers and ``sluice status``.

Every call names a model and job ids, never an arq key: the keys, the envelope and the bounded
enqueue script are this package's (``arq_keys``), so the services stay the same when arq's
internals move. The client is the queue Redis (``SLUICE_QUEUE_URL``, else the one Redis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from services.queue import affinity, arq_keys
from shared import keys

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = [
    "DUPLICATE",
    "ENQUEUED",
    "ENQUEUE_ALL",
    "ENQUEUE_BOUNDED",
    "ENQUEUE_PREFERRING",
    "JOB_TIMEOUT_S",
    "QUEUE_FULL",
    "Queue",
    "Run",
]

JOB_TIMEOUT_S = 6 * 3600  # arq's per-job timeout: only a backstop, leases handle crashes

# The bounded enqueue: arq's own enqueue (a WATCH transaction writing the job payload and the
# queue entry) with the queue bound checked in the same atomic step, so concurrent admissions
# cannot all pass a ``ZCARD`` read before any of them has enqueued. KEYS: queue zset, job
# payload key, job result key. ARGV: job id, payload, score (ms), payload TTL (ms), bound.
# Returns ENQUEUED, DUPLICATE (a job with that id exists or has a result) or QUEUE_FULL.
_ADMIT = """
if redis.call('EXISTS', KEYS[2], KEYS[3]) > 0 then return 0 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[5]) then return -1 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
"""
_RING = """
redis.call('PUBLISH', KEYS[1], ARGV[3])
return 1
"""
ENQUEUE_BOUNDED = _ADMIT + _RING
"""arq's enqueue with the queue's bound checked atomically; a queued job also rings the queue's
doorbell (``services/queue/bell.py``): PUBLISH of its score on the channel named like the queue
(the queue Redis is never a cluster)."""
# The same, recording which worker the job prefers (``affinity.PREFER``: its extra KEYS and
# ARGV follow the bounded enqueue's) before the ring, so the preferred worker's poll sees it.
ENQUEUE_PREFERRING = _ADMIT + affinity.PREFER + _RING
ENQUEUED, DUPLICATE, QUEUE_FULL = 1, 0, -1

# The jobs of one request with ``n`` choices, all or none: nothing is written unless every id
# is new and the queue has room for all of them, so a full queue never starts 2 choices of 3.
# KEYS: queue zset, then each job's payload key and result key. ARGV: score (ms), payload TTL
# (ms), bound, then each job's id and payload. One ring: the jobs share a score, and one poll
# takes them together (which is what lets them share the prompt's prefill on one worker).
ENQUEUE_ALL = """
local n = (#KEYS - 1) / 2
for i = 1, n do
  if redis.call('EXISTS', KEYS[2 * i], KEYS[2 * i + 1]) > 0 then return 0 end
end
if redis.call('ZCARD', KEYS[1]) + n > tonumber(ARGV[3]) then return -1 end
for i = 1, n do
  redis.call('SET', KEYS[2 * i], ARGV[3 + 2 * i], 'PX', ARGV[2])
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2 + 2 * i])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
"""

# msgpack, never pickle: the job envelope is plain data (the worker decodes it the same way).
_ENCODE = msgspec.msgpack.encode


@dataclass(frozen=True, slots=True)
class Run:
    """Where one job id stands in the queue, for the recovery sweeper."""

    queued: bool  # its id is in the queue (waiting, or running: arq keeps it until the end)
    running: bool  # a worker picked it up and has not finished it (arq's in-progress marker)
    # How long ago it was picked up, when the marker's TTL tells (None: not running, or a
    # marker without a TTL).
    running_for_ms: float | None


class Queue:
    """The queues on one Redis client (cheap: one registered script)."""

    def __init__(self, redis: aioredis.Redis, *, job_timeout_s: float = JOB_TIMEOUT_S) -> None:
        """``job_timeout_s``: the arq job timeout the workers run with (the pickup clock)."""
        self.redis = redis
        self.job_timeout_s = job_timeout_s
        self._enqueue = redis.register_script(ENQUEUE_BOUNDED)
        self._enqueue_preferring = redis.register_script(ENQUEUE_PREFERRING)
        self._enqueue_all = redis.register_script(ENQUEUE_ALL)

    async def enqueue(
        self,
        model: str,
        job_id: str,
        payload: bytes,
        *,
        enqueue_ms: int,
        expires_ms: int,
        bound: int,
        prefix: list[bytes] | None = None,
        affinity_wait_ms: int = 0,
    ) -> int:
        """Queue a job (``payload``: a msgpack ``Job``) on ``model``'s queue: refused past
        ``bound`` queued jobs, a no-op for an id already queued or finished, and a ring of the
        queue's doorbell. ``ENQUEUED``, ``DUPLICATE`` or ``QUEUE_FULL``. The job's place is its
        enqueue time (at least 1 ms: arq reads a score of 0 as "no job"). With ``prefix`` (the
        prompt's block hash chain, ``shared.prefix.prompt_chain``) and ``affinity_wait_ms`` > 0,
        the worker holding the longest part of it gets the job first (``affinity.py``)."""
        body = arq_keys.envelope(arq_keys.JOB_FUNCTION, payload, enqueue_ms, _ENCODE)
        keys_ = [keys.queue(model), arq_keys.job(job_id), arq_keys.result(job_id)]
        args: list[Any] = [job_id, body, max(enqueue_ms, 1), expires_ms, bound]
        if prefix is None or affinity_wait_ms <= 0:
            return int(await self._enqueue(keys_, args))
        more_keys, more_args = affinity.prefer_args(model, job_id, prefix, affinity_wait_ms)
        return int(await self._enqueue_preferring([*keys_, *more_keys], [*args, *more_args]))

    async def enqueue_all(
        self,
        model: str,
        jobs: list[tuple[str, bytes]],
        *,
        enqueue_ms: int,
        expires_ms: int,
        bound: int,
    ) -> int:
        """Queue several jobs (``(job id, payload)``) at once or none of them: ``QUEUE_FULL``
        unless all fit under ``bound``, ``DUPLICATE`` if any id is queued or finished, else
        ``ENQUEUED`` and one ring of the doorbell."""
        score = max(enqueue_ms, 1)
        keys_ = [keys.queue(model)]
        args: list[Any] = [score, expires_ms, bound]
        for job_id, payload in jobs:
            keys_ += [arq_keys.job(job_id), arq_keys.result(job_id)]
            args += [job_id, arq_keys.envelope(arq_keys.JOB_FUNCTION, payload, enqueue_ms, _ENCODE)]
        return int(await self._enqueue_all(keys_, args))

    async def size(self, model: str) -> int:
        """Jobs in ``model``'s queue, waiting or running (what the bound counts): one ZCARD."""
        return int(await self.redis.zcard(keys.queue(model)))

    async def waiting(self, model: str) -> list[tuple[str, float]]:
        """The jobs no worker has picked up, oldest first, with their enqueue times (unix ms)."""
        return await arq_keys.waiting(self.redis, keys.queue(model))

    async def remove(self, model: str | None, job_id: str) -> None:
        """Take a job that never started out of the queue (``model`` None: its queue is
        unknown, only its payload goes)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            if model is not None:
                pipe.zrem(keys.queue(model), job_id)
            pipe.delete(arq_keys.job(job_id))
            await pipe.execute()

    async def forget(self, job_id: str) -> None:
        """Free a finished id for a new enqueue: arq's result (e.g. its "expired" record) would
        make the next ``enqueue`` of it a ``DUPLICATE``."""
        await self.redis.delete(arq_keys.result(job_id))

    async def runs(self, model: str, job_ids: list[str]) -> list[Run]:
        """Where each of ``job_ids`` stands (one pipelined round trip).

        arq gives its in-progress marker ``job_timeout_s + IN_PROGRESS_EXTRA_S`` of TTL at
        pickup, so the TTL left tells how long ago the job was picked up.
        """
        async with self.redis.pipeline(transaction=False) as pipe:
            for jid in job_ids:
                pipe.pttl(arq_keys.in_progress(jid))
                pipe.zscore(keys.queue(model), jid)
            flat = await pipe.execute()
        full_ms = (self.job_timeout_s + arq_keys.IN_PROGRESS_EXTRA_S) * 1000
        out = []
        for i in range(len(job_ids)):
            pttl, score = flat[2 * i : 2 * i + 2]
            since = full_ms - pttl if pttl > 0 else None
            out.append(Run(queued=score is not None, running=pttl != -2, running_for_ms=since))
        return out

    async def running_ids(self, model: str, limit: int) -> list[str]:
        """The ids among the first ``limit`` of ``model``'s queue that a worker picked up (the
        ones each poll reads: dead runs there keep new jobs from starting)."""
        jids = [j.decode() for j in await self.redis.zrange(keys.queue(model), 0, limit - 1)]
        if not jids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for jid in jids:
                pipe.exists(arq_keys.in_progress(jid))
            running = await pipe.execute()
        return [j for j, r in zip(jids, running, strict=True) if r]

    async def repair(self, model: str, dead_runs: list[str]) -> None:
        """Remove dead runs (job ids no worker is doing): queue entry, in-progress marker and
        payload.

        arq keeps a running job's id in the queue until the job finishes, and its in-progress
        key lives ``job_timeout + 10`` s (hours here). A SIGKILLed worker finishes nothing, so
        without this every worker re-checks those ids on every poll (a transaction each, ~6,000
        idle Redis ops/s after one kill in the field) and enough of them fill the ids arq reads
        per poll (``queue_read_limit``) so that no new request ever starts.
        """
        if not dead_runs:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(keys.queue(model), *dead_runs)
            pipe.delete(*map(arq_keys.in_progress, dead_runs), *map(arq_keys.job, dead_runs))
            await pipe.execute()
