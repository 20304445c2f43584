"""The API-side start timeout: end a request no worker started by its start deadline.

Each request carries its deadline, ``start_by`` in its hash: its creation time plus the
``start_timeout_s`` of the API that admitted it, so every replica ends it at the same moment.

A crashed or absent worker leaves a queued job untouched for as long as arq's keys live (arq
#343, #407), so a client would wait on a silent stream forever. The streaming pipeline therefore
bounds the wait for a request's first event and then calls ``claim_unstarted``; for requests
nobody is watching (a background Responses request, a client that left), ``sweep_loop`` does the
same from the in-flight sets every few seconds.

Ending the request must never race a worker that picks it up at the same moment into a second
terminal event or a ``Start`` after the ``Error``. The claim is the protocol's
``CLAIM_UNSTARTED`` script (``shared.protocol``) over the request's own keys: if the stream holds
any event, a worker started it (nothing to do); else it takes the request lease as
``api-timeout`` with ``SET NX`` (the lease the worker's ``ACQUIRE`` and fenced ``PUBLISH``
scripts check) and appends ``Error(overloaded, retryable)``. A worker that already holds the
lease makes the ``SET NX`` fail, so the API backs off; a worker that comes later finds the lease
taken (``ACQUIRE`` refuses it) or the terminal event in the history it reads first, and does
nothing. Only after a successful claim is the job removed from the queue (``Queue.remove``) and
the request dropped from the in-flight set (best effort: the lease already fences any worker).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from services.queue.client import Queue
from shared import keys
from shared.codec import encode_events
from shared.config import Settings
from shared.events import Error
from shared.protocol import Claim, Scripts

__all__ = [
    "claim_unstarted",
    "start_deadline",
    "sweep_loop",
    "sweep_unstarted",
]

logger = logging.getLogger(__name__)


async def start_deadline(redis: aioredis.Redis, rid: str, settings: Settings) -> float:
    """The ``time.monotonic()`` by which a request's first event must have arrived.

    The deadline is the request's own ``start_by`` (unix seconds, set at admission from the
    admitting API's ``start_timeout_s``), so a client that reconnects, or reads through another
    replica with another setting, waits for the same moment. A request stored without one
    counts ``start_timeout_s`` from its ``created`` time, or from now.

    Args:
        redis: the command client.
        rid: the request id.
        settings: the process settings (``start_timeout_s``, for requests without ``start_by``).

    Returns:
        The deadline on the monotonic clock.
    """
    created, start_by = await redis.hmget(keys.request(rid), ["created", "start_by"])  # type: ignore[misc]
    return time.monotonic() + (_start_by(created, start_by, settings) - time.time())


def _start_by(created: bytes | None, start_by: bytes | None, settings: Settings) -> float:
    """A request's start deadline in unix seconds, from its hash's ``start_by``/``created``."""
    now = time.time()
    try:
        if start_by is not None:
            return float(start_by)
        return (float(created) if created is not None else now) + settings.start_timeout_s
    except ValueError:
        return now + settings.start_timeout_s


async def claim_unstarted(
    redis: aioredis.Redis, rid: str, settings: Settings, *, queue: Queue | None = None
) -> int:
    """End a request that no worker has started with ``Error(overloaded, retryable=True)``.

    Args:
        redis: the command client (the events Redis).
        rid: the request id.
        settings: the process settings (lease TTL, stream cap, retention).
        queue: the model queues, when they are not on ``redis``.

    Returns:
        A ``Claim`` value: ``TIMED_OUT`` when this call wrote the Error (the event reaches every
        subscriber through the stream like any other), ``STARTED`` or ``HELD`` when a worker got
        there first, ``GONE`` when the request no longer exists.
    """
    created, start_by = await redis.hmget(keys.request(rid), ["created", "start_by"])  # type: ignore[misc]
    waited = round(_start_by(created, start_by, settings) - float(created or time.time()), 1)
    error = Error(
        kind="overloaded",
        message=f"no worker started this request within {waited:g}s",
        retryable=True,
    )
    # The lease outlives the stream's readers: a worker that read an empty history just before
    # the claim must still find the lease taken when its ACQUIRE runs.
    result = await Scripts(redis).claim_unstarted(
        rid,
        encode_events([error]),
        lease_ms=int(settings.retention_s * 1000),
        maxlen=settings.stream_maxlen,
        retention_s=settings.retention_s,
        unstored_retention_s=settings.unstored_retention_s,
    )
    if result == Claim.TIMED_OUT:
        logger.warning("%s: no worker started it within %gs", rid, waited)
        await _dequeue(redis, queue or Queue(redis), rid)
    return result


async def _dequeue(redis: aioredis.Redis, queue: Queue, rid: str) -> None:
    try:
        model = await redis.hget(keys.request(rid), "model")  # type: ignore[misc]
        if model is not None:
            await redis.zrem(keys.inflight(model.decode()), rid)
        await queue.remove(None if model is None else model.decode(), rid)
    except Exception:  # boundary: the lease already fences any worker; this is tidying up
        logger.exception("%s: could not remove the timed-out job", rid)


async def sweep_unstarted(
    redis: aioredis.Redis, settings: Settings, *, queue: Queue | None = None
) -> list[str]:
    """Time out every in-flight request past its own start deadline that no worker started.

    Candidates come from ``sluice:inflight:{model}``; the started ones (the usual case) are
    dropped on their stream's length, the rest compared with their ``start_by`` (each
    request's own deadline, so a replica with a longer ``start_timeout_s`` still ends a request
    admitted with a shorter one on time), and each one past it is settled by
    ``claim_unstarted``: a started or leased request is left alone, and several API processes
    sweeping at once still write at most one Error.

    Args:
        redis: the command client (the events Redis).
        queue: the model queues, when they are not on ``redis``.
        settings: the process settings.

    Returns:
        The request ids this call timed out.
    """
    now = time.time()
    timed_out: list[str] = []
    for raw_model in await redis.smembers(keys.models()):  # type: ignore[misc]
        model = raw_model.decode()
        members = await redis.zrange(keys.inflight(model), 0, -1)
        if not members:
            continue
        # one round trip for every candidate's stream length and deadline
        async with redis.pipeline(transaction=False) as pipe:
            for rid in members:
                pipe.xlen(keys.events(rid.decode()))
                pipe.hmget(keys.request(rid.decode()), ["created", "start_by"])
            replies = await pipe.execute()
        for i, rid in enumerate(members):
            length, (created, start_by) = replies[2 * i], replies[2 * i + 1]
            if length or (created is not None and now < _start_by(created, start_by, settings)):
                continue
            result = await claim_unstarted(redis, rid.decode(), settings, queue=queue)
            if result == Claim.TIMED_OUT:
                timed_out.append(rid.decode())
            elif result == Claim.GONE:  # a leftover entry: its request expired
                await redis.zrem(keys.inflight(model), rid)
    return timed_out


async def sweep_loop(redis: aioredis.Redis, queue: Queue, settings: Settings) -> None:
    """``sweep_unstarted`` every ``min(start_timeout_s / 4, 5 s)`` until cancelled.

    Args:
        redis: the command client (the events Redis).
        queue: the model queues.
        settings: the process settings.
    """
    period = max(0.05, min(settings.start_timeout_s / 4, 5.0))
    while True:
        await asyncio.sleep(period)
        try:
            await sweep_unstarted(redis, settings, queue=queue)
        except Exception:  # boundary: a Redis hiccup must not end the sweeping for good
            logger.exception("start-timeout sweep failed")
