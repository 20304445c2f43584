"""The worker's periodic pulse: heartbeat hash, worker registry and request leases.

Every ``heartbeat_s`` one pipeline (one round trip, whatever the number of active requests)
writes ``sluice:worker:{wid}`` (model, slots, active, version, device, tokens/s since the last
beat, tokens generated and requests served; TTL three beats), scores the worker
in ``sluice:workers``, and refreshes the lease of every request this worker is generating while
reading its cancel flag. The same pipeline re-publishes the model card's name and checks the
card is still there, writing it again if not: a Redis that restarted without persistence (or
failed over to an empty replica) has lost it, and without it the API answers 404 for a model
that is being served. The hash's ``polled`` field is when the worker last polled its queue
(``services.queue.poll_backoff.PollMark``): ``/readyz`` counts a worker only once it has polled
since Redis started, since heartbeats resume before a backed-off queue poll does. Per-step
cancellation is the publisher's job (the flag rides on every publish); this loop only rescues a
request whose step is stuck (e.g. a long prefill), by cancelling its task once it has been
silent for a beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from importlib import metadata

from redis.exceptions import RedisError

from services.queue.poll_backoff import PollMark
from services.worker.job_function import WorkerContext
from shared import keys
from shared.protocol import LEASE_LOST, Scripts

__all__ = ["VERSION", "beat_once", "device_of", "heartbeat_loop", "retire"]

log = logging.getLogger(__name__)

try:
    VERSION = metadata.version("sluice")
except metadata.PackageNotFoundError:  # running from a source tree without installing
    VERSION = "0+unknown"


def _tokens_per_s(wc: WorkerContext) -> float:
    """Tokens per second since the previous beat (``status`` shows it per worker)."""
    now = time.monotonic()
    at, tokens = wc.rate_mark
    wc.rate_mark = (now, wc.generated)
    return max(wc.generated - tokens, 0) / max(now - at, 1e-6)


async def beat_once(wc: WorkerContext, mark: PollMark | None = None) -> None:
    """One heartbeat: registry entries plus every active lease, in one pipeline."""
    now_ms = int(time.time() * 1000)
    ttl_ms = int(wc.settings.heartbeat_s * 3000)
    lease_ms = int(wc.settings.lease_ttl_s * 1000)
    active = list(wc.active.values())
    scripts = Scripts(wc.redis)
    async with wc.redis.pipeline(transaction=False) as pipe:
        pipe.hset(
            keys.worker(wc.wid),
            mapping={
                "model": wc.name,
                "slots": wc.backend.max_batch,
                "active": len(active),
                "version": VERSION,
                "started": int(wc.started),
                "device": device_of(wc),
                "tokens_per_s": f"{_tokens_per_s(wc):.1f}",
                "generated": wc.generated,
                "served": wc.served,
                **({"polled": mark.polled_ms} if mark is not None else {}),
            },
        )
        pipe.pexpire(keys.worker(wc.wid), ttl_ms)
        pipe.zadd(keys.workers(), {wc.wid: now_ms})
        # Anything not seen for a minute is gone: keep the registry from growing forever.
        pipe.zremrangebyscore(keys.workers(), "-inf", now_ms - max(ttl_ms, 60_000))
        pipe.sadd(keys.models(), wc.name)
        pipe.exists(keys.model_card(wc.name))
        for job in active:
            await scripts.queue_refresh(pipe, job.rid, wc.wid, lease_ms)
        sent = time.perf_counter()
        results = await pipe.execute(raise_on_error=False)
        wc.metrics.redis_rtt.labels("heartbeat").observe(time.perf_counter() - sent)
    if results[5] == 0 and wc.card:  # only when missing: a real card is megabytes of tokenizer
        log.warning("model card of %s missing from Redis; publishing it again", wc.name)
        await wc.redis.hset(keys.model_card(wc.name), "card", wc.card)  # type: ignore[misc,arg-type]
    for job, result in zip(active, results[6:], strict=True):
        if isinstance(result, Exception):
            log.warning("%s: lease refresh failed: %s", job.rid, result)
            continue
        if result == LEASE_LOST:
            job.lease_lost = True
        elif result == 1:
            job.cancel_requested = True
        stuck = time.monotonic() - job.last_step > wc.settings.heartbeat_s
        if (job.lease_lost or job.cancel_requested) and stuck and job.task is not None:
            job.task.cancel()  # the publish path would see it too, but this step is stuck


def device_of(wc: WorkerContext) -> str:
    """What the backend runs on (``cuda:0``, ``cpu``; ``none`` for the scripted double)."""
    return str(getattr(wc.backend, "device", "none"))


async def heartbeat_loop(wc: WorkerContext, mark: PollMark | None = None) -> None:
    """Beat every ``heartbeat_s`` until cancelled, and at once when ``mark`` asks (the first
    poll after a failure: readiness should not wait a period); Redis hiccups are logged."""
    while True:
        try:
            await beat_once(wc, mark)
        except RedisError as exc:
            log.warning("heartbeat failed: %s", exc)
        if mark is None:
            await asyncio.sleep(wc.settings.heartbeat_s)
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wc.settings.heartbeat_s):
                await mark.beat_now.wait()
        mark.beat_now.clear()


async def retire(wc: WorkerContext) -> None:
    """Remove this worker from the registry (clean shutdown)."""
    async with wc.redis.pipeline(transaction=False) as pipe:
        pipe.delete(keys.worker(wc.wid))
        pipe.zrem(keys.workers(), wc.wid)
        await pipe.execute()
