"""arq's own Redis keys, named in one place so no other module reads ``arq.constants``.

arq (https://github.com/python-arq/arq, ``arq/constants.py`` and ``arq/worker.py``) keeps each
job under keys derived from its id: the serialized job at ``arq:job:<id>`` until a worker
finishes it, a marker ``arq:in-progress:<id>`` while a worker runs it (set at pickup with a TTL
of the longest function timeout plus ten seconds), its result at ``arq:result:<id>``, and more
beside; the job payload is arq's envelope (``arq.jobs.serialize_job``). These are arq internals,
not its public API; the start timeout (API) and the recovery sweeper (worker) read them, so an
arq upgrade that moves them breaks here and nowhere else. Both services may import this module;
``shared`` may not, because it must not import arq.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix
from arq.jobs import serialize_job

from shared.protocol import JOB_FUNCTION, Scripts

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from arq.connections import ArqRedis

__all__ = [
    "IN_PROGRESS_EXTRA_S",
    "enqueue",
    "envelope",
    "in_progress",
    "job",
    "result",
    "waiting",
]

IN_PROGRESS_EXTRA_S = 10  # arq's in-progress TTL is the job timeout plus this (Worker.__init__)


def job(job_id: str) -> str:
    """The serialized job (function, payload, enqueue time); gone once it finished."""
    return job_key_prefix + job_id


def in_progress(job_id: str) -> str:
    """Set while a worker runs the job, TTL ``job_timeout + IN_PROGRESS_EXTRA_S``."""
    return in_progress_key_prefix + job_id


async def waiting(redis: aioredis.Redis, queue_key: str) -> list[tuple[str, float]]:
    """The jobs of a queue that no worker has picked up, oldest first, with their enqueue times.

    arq leaves a running job's id in the queue until it finishes (with an in-progress marker
    beside it), so the queue's size counts running jobs too; this skips them. One ZRANGE and
    one pipeline of EXISTS: for scrapes and ``sluice status``, not for a request's path.

    Returns:
        ``(job id, enqueue time in unix ms)`` pairs (arq scores a job with the time it may run).
    """
    members = await redis.zrange(queue_key, 0, -1, withscores=True)
    if not members:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for member, _ in members:
            pipe.exists(in_progress(member.decode()))
        running = await pipe.execute()
    return [(m.decode(), score) for (m, score), r in zip(members, running, strict=True) if not r]


def result(job_id: str) -> str:
    """A finished job's result; while it exists the id cannot be enqueued again."""
    return result_key_prefix + job_id


def envelope(
    function: str, payload: bytes, enqueue_ms: int, serializer: Callable[[Any], bytes]
) -> bytes:
    """The bytes arq stores at ``job(id)``: function name, arguments and enqueue time."""
    return serialize_job(function, (payload,), {}, None, enqueue_ms, serializer=serializer)


async def enqueue(
    arq: ArqRedis,
    model: str,
    job_id: str,
    payload: bytes,
    *,
    enqueue_ms: int,
    expires_ms: int,
    bound: int,
) -> int:
    """Queue a ``generate`` job on ``model``'s queue as arq would, through ``ENQUEUE_BOUNDED``:
    refused past ``bound`` queued jobs, a no-op for an id already queued or finished, and a ring
    of the queue's doorbell. ``ENQUEUED``, ``DUPLICATE`` or ``QUEUE_FULL``. The job's place is
    its enqueue time (at least 1 ms: arq reads a score of 0 as "no job")."""
    serializer: Callable[[Any], bytes] = arq.job_serializer or msgspec.msgpack.encode
    return await Scripts(arq).enqueue_bounded(
        model,
        job_id,
        envelope(JOB_FUNCTION, payload, enqueue_ms, serializer),
        job_key=job(job_id),
        result_key=result(job_id),
        score_ms=max(enqueue_ms, 1),
        expires_ms=expires_ms,
        bound=bound,
    )
