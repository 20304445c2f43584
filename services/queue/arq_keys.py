"""arq's own Redis keys, named in one place so no other module reads ``arq.constants``.

arq (https://github.com/python-arq/arq, ``arq/constants.py`` and ``arq/worker.py``) keeps each
job under keys derived from its id: the serialized job at ``arq:job:<id>`` until a worker
finishes it, a marker ``arq:in-progress:<id>`` while a worker runs it (set at pickup with a TTL
of the longest function timeout plus ten seconds), its result at ``arq:result:<id>``, and more
beside; the job payload is arq's envelope (``arq.jobs.serialize_job``). These are arq internals,
not its public API; only the queue package (``services.queue``) reads them, so an arq upgrade
that moves them breaks here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix
from arq.jobs import serialize_job

if TYPE_CHECKING:
    import redis.asyncio as aioredis

# The name the one job function has in arq's envelope: the queue enqueues under it and the
# consumer registers the worker's function under it, so it never leaves this package.
JOB_FUNCTION = "generate"

__all__ = [
    "IN_PROGRESS_EXTRA_S",
    "JOB_FUNCTION",
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
