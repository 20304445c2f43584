"""The worker's side of the queue: ``Consumer`` takes one model's jobs, as many at once as the
backend has slots, and runs each as ``handler(payload)``.

arq is the engine (``OwnJobsWorker``), configured against its measured pitfalls
(docs/benchmarks.md, docs/architecture.md): explicit keyword arguments (``WorkerSettings``
inheritance is silently ignored), msgpack envelopes (never pickle), ``max_jobs`` = the
backend's batch size, a short ``poll_delay``, ``max_tries=1`` and no retries (the lease and the
sweeper recover crashed requests, continuing instead of restarting), a long ``job_timeout`` (a
generation is not a stuck job), and a health-check key per worker. Polls wait for the queue's
doorbell (``bell.py``) when ``idle_poll_s`` is set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import redis.asyncio as aioredis
from arq.connections import ArqRedis
from arq.worker import Worker, func
from redis.exceptions import RedisError

from services.queue.affinity import Claims, Holdings
from services.queue.arq_keys import JOB_FUNCTION
from services.queue.bell import QueueBell
from services.queue.client import JOB_TIMEOUT_S, Queue
from services.queue.poll_backoff import Backoff, PollMark
from shared import keys

__all__ = ["Consumer", "OwnJobsWorker", "arq_deserialize", "arq_serialize"]

log = logging.getLogger(__name__)

# arq stores failure results as exception objects; msgpack cannot, so they become their repr.
_ARQ_ENCODER = msgspec.msgpack.Encoder(enc_hook=repr)


def arq_serialize(obj: Any) -> bytes:
    """arq ``job_serializer``: msgpack (job envelopes ``{t,f,a,k,et}`` are plain data)."""
    return _ARQ_ENCODER.encode(obj)


def arq_deserialize(data: bytes) -> Any:
    """arq ``job_deserializer``: msgpack, never pickle."""
    return msgspec.msgpack.decode(data)


class OwnJobsWorker(Worker):
    """arq's ``Worker`` without a Redis transaction per running job per poll, that rides out
    a Redis outage.

    arq leaves a job's id in the queue until the job finishes, so every poll (every 10 ms here)
    re-checks each job this worker is already running with a WATCH/EXISTS/ZSCORE transaction.
    While one stream decoded that was ~40 % of the worker's event-loop CPU (py-spy), plus the
    Redis work, all taken from the cores the model runs on. Ids of this worker's own unfinished
    jobs are skipped before that check; everything else goes through arq unchanged.

    arq's poll loop has no error handling: the first failed command (a Redis restart, a
    failover) ends ``main`` and with it the worker. Here a failed poll is retried with a
    capped exponential backoff (poll_backoff.py: at most half a second between attempts), so
    consumption resumes by itself within that of Redis answering. While retrying, the doorbell
    is not waited for: its subscription may look alive on a connection that is dead, and each
    attempt would wait out the idle poll on top of the stated delay.
    """

    bell: QueueBell | None = None  # set: poll when it rings (bell.py), not every delay
    claims: Claims | None = None  # set: cache-aware pickup (affinity.py) filters each poll
    holdings: Holdings | None = None  # set: told when a slot is taken or freed
    on_pickup: Callable[[str], None] | None = None  # each started job's affinity outcome
    _wake: asyncio.TimerHandle | None = None  # the next poll, for a job left to another worker
    polls = 0  # queue polls made
    backoff: Backoff | None = None  # set per instance on the first failure
    mark: PollMark | None = None  # set: successful polls are recorded for the heartbeat

    async def _poll_iteration(self) -> None:
        backoff = self.backoff
        if self.bell is not None and (backoff is None or not backoff.failures):
            await self.bell.wait()
        self.polls += 1
        started, started_ms = time.monotonic(), int(time.time() * 1000)
        try:
            await super()._poll_iteration()
        except (RedisError, OSError) as exc:
            backoff = self.backoff = backoff or Backoff()
            wait_s = backoff.failed(started)
            # every failure at debug, warnings rate-limited through a long outage
            log.log(
                logging.WARNING if backoff.log_due() else logging.DEBUG,
                "queue poll failed (%s); retrying in %.2f s (%d failures in a row)",
                exc,
                wait_s,
                backoff.failures,
            )
            await asyncio.sleep(wait_s)
            return
        recovered = backoff is not None and backoff.succeeded()
        if self.mark is not None:
            self.mark.polled(started_ms, urgent=recovered or self.polls == 1)
        if recovered:
            log.warning("queue poll recovered")

    async def run_job(self, job_id: str, score: int) -> None:
        try:
            await super().run_job(job_id, score)
        finally:
            if self.bell is not None:  # a slot is free: a job left waiting for one can start
                self.bell.ring()

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """Start the jobs among ``job_ids`` that this worker is not already running (and, with
        cache-aware pickup, may start now)."""
        running = {jid for jid, task in self.tasks.items() if not task.done()}
        ids = [j for j in job_ids if j.decode() not in running]
        outcomes: dict[str, str] = {}
        if self.claims is not None and ids:
            outcomes, soonest = await self.claims.claimable([j.decode() for j in ids])
            ids = [j for j in ids if j.decode() in outcomes]
            if soonest is not None:
                self._poll_at(soonest)
        try:
            await super().start_jobs(ids)
        except (RedisError, OSError):
            # arq failed between taking a slot (counter + semaphore) and starting the task,
            # the only place its loop can raise: give that one slot back or it leaks for good.
            self.job_counter -= 1
            self.sem.release()
            raise
        finally:
            self._started(outcomes, running)

    def _started(self, outcomes: dict[str, str], running: set[str]) -> None:
        """Count the affinity outcome of each job this poll started, and publish the slots."""
        started = [jid for jid in outcomes if jid in self.tasks and jid not in running]
        if self.on_pickup is not None:
            for jid in started:
                self.on_pickup(outcomes[jid])
        if started and self.holdings is not None:
            self.holdings.changed()
            changed = self.holdings.changed
            for jid in started:
                # after arq's own callback, which gives the slot back: the next publish counts it
                self.tasks[jid].add_done_callback(lambda _: changed())

    def _poll_at(self, delay_s: float) -> None:
        """Poll again in ``delay_s`` (a job left to its preferred worker may be ours by then)."""
        if self.bell is None:
            return  # polls come every poll delay anyway
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s + 0.001
        if self._wake is None or self._wake.when() <= loop.time() or self._wake.when() > when:
            if self._wake is not None:
                self._wake.cancel()
            self._wake = loop.call_at(when, self.bell.ring)


class Consumer:
    """One worker's consumption of one model's queue (``run`` until cancelled)."""

    def __init__(
        self,
        url: str,
        model: str,
        handler: Callable[[bytes], Awaitable[None]],
        *,
        max_jobs: int,
        poll_delay_s: float,
        idle_poll_s: float,
        health_key: str,
        connect_timeout_s: float,
        mark: PollMark | None = None,
        affinity_wid: str | None = None,
        journal: deque[tuple[bool, bytes]] | None = None,
        on_pickup: Callable[[str], None] | None = None,
    ) -> None:
        """Connect (lazily) to the queue Redis at ``url``; ``handler`` runs one job's payload
        (a msgpack ``Job``); ``health_key``: arq's per-worker health-check key; ``mark``: told
        of every successful poll (the heartbeat's readiness). ``affinity_wid`` turns on
        cache-aware pickup as that worker (``affinity.py``): it publishes the blocks its prefix
        cache holds from ``journal`` (the block pool's; None: slots only) and reports each
        started job's outcome to ``on_pickup``."""
        self._arq = ArqRedis(
            aioredis.ConnectionPool.from_url(url, socket_connect_timeout=connect_timeout_s),
            job_serializer=arq_serialize,
            job_deserializer=arq_deserialize,
            default_queue_name=keys.queue(model),
        )
        self.queue = Queue(self._arq, job_timeout_s=JOB_TIMEOUT_S)  # the sweeper's repairs

        async def job(ctx: dict[str, Any], payload: bytes) -> None:  # arq's job signature
            await handler(payload)

        self.worker = OwnJobsWorker(
            functions=[func(job, name=JOB_FUNCTION, max_tries=1)],
            queue_name=keys.queue(model),
            redis_pool=self._arq,
            handle_signals=False,  # the worker owns SIGTERM: drain, hand over, deregister
            max_jobs=max_jobs,
            poll_delay=poll_delay_s,
            job_timeout=JOB_TIMEOUT_S,
            max_tries=1,
            retry_jobs=False,
            # No results: nobody reads them (events go to the stream), and arq's result repeats
            # the job's arguments, i.e. the prompt, beyond a deleted response. A duplicate of a
            # finished job is harmless: the job function sees the terminal event and does
            # nothing.
            keep_result=0,
            health_check_key=health_key,
            health_check_interval=10,
            job_serializer=arq_serialize,
            job_deserializer=arq_deserialize,
            log_results=False,
        )
        self.worker.mark = mark
        if idle_poll_s > 0:
            self.worker.bell = QueueBell(self._arq, keys.queue(model), idle_poll_s)
        if affinity_wid is not None:
            w = self.worker
            self.worker.claims = Claims(self._arq, model, affinity_wid)
            self.worker.holdings = Holdings(
                self._arq,
                model,
                affinity_wid,
                lambda: (w.max_jobs - w.job_counter if w.allow_pick_jobs else 0, w.job_counter),
                journal,
            )
            self.worker.on_pickup = on_pickup

    async def run(self) -> None:
        """Poll and run jobs until cancelled (or until arq's loop fails for good)."""
        await self.worker.async_run()

    def background(self) -> list[Coroutine[Any, Any, None]]:
        """What must run beside ``run`` as tasks: the doorbell's subscription, when there is one."""
        loops = [] if self.worker.bell is None else [self.worker.bell.listen()]
        if self.worker.holdings is not None:
            loops.append(self.worker.holdings.run())
        return loops

    def stop_taking(self) -> None:
        """Take no new jobs; running ones go on."""
        self.worker.allow_pick_jobs = False
        if self.worker.holdings is not None:  # no slot free: preferred for nothing more
            self.worker.holdings.changed()

    def running(self) -> list[asyncio.Task[Any]]:
        """The jobs this consumer runs now."""
        return [t for t in self.worker.tasks.values() if not t.done()]

    async def retire(self) -> None:
        """Remove this worker's health-check key and its prefix holdings (a clean stop)."""
        await self._arq.delete(self.worker.health_check_key)
        if self.worker.holdings is not None:
            await self.worker.holdings.retire()

    async def aclose(self) -> None:
        """Close the queue connections."""
        await self._arq.aclose(close_connection_pool=True)
