"""Worker start-up: load a backend, publish its card, run the arq worker and the background loops.

``run_worker`` is what ``sluice worker`` calls. ``start_worker`` starts everything as tasks on
the running event loop and returns a ``RunningWorker`` (the test harness uses it directly).

arq is configured against its measured pitfalls (docs/benchmarks.md, docs/architecture.md):
explicit keyword arguments (``WorkerSettings`` inheritance is silently ignored), msgpack envelopes
(never pickle), ``max_jobs`` = the backend's batch size, a short ``poll_delay``, ``max_tries=1`` and
no retries (our lease + sweeper recover crashed requests, continuing instead of restarting), a
long ``job_timeout`` (a generation is not a stuck job), and a health-check key per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import signal
import socket
import sys
import time
import uuid
from typing import Any

import msgspec
import redis.asyncio as aioredis
from arq.connections import ArqRedis
from arq.worker import Worker, func
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
    RedisError,
    TimeoutError as RedisTimeoutError,
)

from services import redis_conn
from services.worker.backend import Backend
from services.worker.heartbeat import VERSION, beat_once, device_of, heartbeat_loop, retire
from services.worker.job_function import CTX_KEY, WorkerContext, generate
from services.worker.poll_backoff import Backoff, PollMark
from services.worker.publish_pipe import PublishPipe
from services.worker.queue_bell import QueueBell
from services.worker.recovery import sweep_loop
from shared import keys, logs
from shared.config import Settings
from shared.model_card import encode_card
from shared.protocol import JOB_FUNCTION, Scripts

__all__ = [
    "JOB_TIMEOUT_S",
    "SHUTDOWN_GRACE_S",
    "RunningWorker",
    "arq_deserialize",
    "arq_serialize",
    "load_backend",
    "run_worker",
    "start_worker",
]

log = logging.getLogger(__name__)

JOB_TIMEOUT_S = 6 * 3600  # arq's per-job timeout: only a backstop, leases handle crashes
SHUTDOWN_GRACE_S = 5.0  # SIGTERM: let in-flight requests finish this long, then hand them over
START_BACKOFF_MAX_S = 1.0  # the longest wait between start-up attempts to reach Redis
# A connect that hangs (SYNs dropped while Redis's host or container restarts) gives up after
# this, so the next attempt's fresh SYN reaches Redis once it is back instead of waiting out the
# kernel's SYN retransmissions (1, 3, 7, 15 s...). Reaching a Redis takes milliseconds.
CONNECT_TIMEOUT_S = 1.0

# arq stores failure results as exception objects; msgpack cannot, so they become their repr.
_ARQ_ENCODER = msgspec.msgpack.Encoder(enc_hook=repr)


def arq_serialize(obj: Any) -> bytes:
    """arq ``job_serializer``: msgpack (job envelopes ``{t,f,a,k,et}`` are plain data)."""
    return _ARQ_ENCODER.encode(obj)


def arq_deserialize(data: bytes) -> Any:
    """arq ``job_deserializer``: msgpack, never pickle."""
    return msgspec.msgpack.decode(data)


def load_backend(settings: Settings, model_spec: str, name: str | None) -> Backend:
    """``scripted:...`` builds the test double; anything else loads a model through the engine."""
    if model_spec.startswith("scripted:") or model_spec == "scripted":
        from services.worker.scripted import parse_spec

        return parse_spec(model_spec, name)
    from services.worker.torch_backend import TorchBackend

    return TorchBackend.load(settings, model_spec, name)


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

    bell: QueueBell | None = None  # set: poll when it rings (queue_bell.py), not every delay
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
        """Start the jobs among ``job_ids`` that this worker is not already running."""
        running = {jid for jid, task in self.tasks.items() if not task.done()}
        try:
            await super().start_jobs([j for j in job_ids if j.decode() not in running])
        except (RedisError, OSError):
            # arq failed between taking a slot (counter + semaphore) and starting the task,
            # the only place its loop can raise: give that one slot back or it leaks for good.
            self.job_counter -= 1
            self.sem.release()
            raise


class RunningWorker:
    """A started worker: the arq worker plus the heartbeat and recovery loops."""

    def __init__(self, wc: WorkerContext, arq: ArqRedis, worker: Worker) -> None:
        """Start the tasks (called by ``start_worker``)."""
        self.wc = wc
        self.arq = arq
        self.worker = worker
        # Every line this worker's tasks log names it (several workers share a test process).
        ctx = contextvars.copy_context()
        ctx.run(logs.bind, worker=wc.wid, model=wc.name)
        self.main_task = asyncio.create_task(
            worker.async_run(), name=f"arq-{wc.wid}", context=ctx.copy()
        )
        self._loops = [
            asyncio.create_task(
                heartbeat_loop(wc, getattr(worker, "mark", None)),
                name=f"beat-{wc.wid}",
                context=ctx.copy(),
            ),
            asyncio.create_task(
                sweep_loop(wc, arq, JOB_TIMEOUT_S), name=f"sweep-{wc.wid}", context=ctx.copy()
            ),
        ]
        if isinstance(worker, OwnJobsWorker) and worker.bell is not None:
            bell = worker.bell.listen()
            self._loops.append(asyncio.create_task(bell, name=f"bell-{wc.wid}", context=ctx.copy()))
        self._closed = False

    @property
    def name(self) -> str:
        """The public model id served."""
        return self.wc.name

    @property
    def wid(self) -> str:
        """This worker's id."""
        return self.wc.wid

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Graceful stop: take no new jobs, let running ones finish for ``grace_s``, then hand
        them to a live peer (or end them with ``Error(worker_lost)``), and deregister."""
        if self._closed:
            return
        self.worker.allow_pick_jobs = False
        running = [t for t in self.worker.tasks.values() if not t.done()]
        if running:
            await asyncio.wait(running, timeout=grace_s)
        self.wc.stopping = True
        await self._cancel_all()
        with contextlib.suppress(Exception):
            await retire(self.wc)
            await self.arq.delete(self.worker.health_check_key)
        await self._close()

    async def kill(self) -> None:
        """Hard kill, as SIGKILL would: no terminal events, leases left to expire, no goodbye."""
        if self._closed:
            return
        self.wc.killed = True
        await self._cancel_all()
        await self._close()

    async def _cancel_all(self) -> None:
        tasks = [t for t in self.worker.tasks.values() if not t.done()]
        for t in [*tasks, self.main_task, *self._loops]:
            t.cancel()
        await asyncio.gather(*tasks, self.main_task, *self._loops, return_exceptions=True)

    async def _close(self) -> None:
        self._closed = True
        self.wc.metrics.close()
        await self.arq.aclose(close_connection_pool=True)
        if self.wc.pipe is not None:
            await self.wc.pipe.aclose()
        await self.wc.redis.aclose()
        await self.wc.backend.stop()


async def start_worker(
    settings: Settings, backend: Backend, *, wid: str | None = None
) -> RunningWorker:
    """Start a worker for ``backend`` on the running loop: card, heartbeat, arq, sweeper."""
    redis = redis_conn.client(
        settings.events_redis_url, worker=True, socket_connect_timeout=CONNECT_TIMEOUT_S
    )
    try:
        await redis.ping()
        await backend.start()
    except BaseException:
        await redis.aclose()
        raise
    card = msgspec.structs.replace(backend.card, created=int(time.time()))
    name = card.name
    wid = wid or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    wc = WorkerContext(
        settings=settings, redis=redis, backend=backend, name=name, wid=wid, card=encode_card(card)
    )
    wc.pipe = PublishPipe(redis, Scripts(redis).publish_source)
    wc.metrics.bind(
        model=name,
        wid=wid,
        device=device_of(wc),
        version=VERSION,
        running=lambda: float(len(wc.active)),
        engine=getattr(backend, "scheduler", None),
    )
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.model_card(name), "card", wc.card)  # type: ignore[arg-type]
        pipe.sadd(keys.models(), name)
        await pipe.execute()
    mark = PollMark()  # not polled yet: /readyz does not count this worker until it has
    await beat_once(wc, mark)  # registered before the first job can arrive
    arq = ArqRedis(
        aioredis.ConnectionPool.from_url(
            redis_conn.queue_client_url(settings.queue_redis_url),
            socket_connect_timeout=CONNECT_TIMEOUT_S,
        ),
        job_serializer=arq_serialize,
        job_deserializer=arq_deserialize,
        default_queue_name=keys.queue(name),
    )
    wc.queue = arq  # the sweeper's view of arq's keys
    worker = OwnJobsWorker(
        functions=[func(generate, name=JOB_FUNCTION, max_tries=1)],
        queue_name=keys.queue(name),
        redis_pool=arq,
        ctx={CTX_KEY: wc},
        handle_signals=False,  # we own SIGTERM: drain, hand over, deregister
        max_jobs=backend.max_batch,
        poll_delay=settings.poll_delay_s,
        job_timeout=JOB_TIMEOUT_S,
        max_tries=1,
        retry_jobs=False,
        # No results: nobody reads them (events go to the stream), and arq's result repeats the
        # job's arguments, i.e. the prompt, beyond a deleted response. A duplicate of a finished
        # job is harmless: the job function sees the terminal event and does nothing.
        keep_result=0,
        health_check_key=f"{keys.worker(wid)}:arq",
        health_check_interval=10,
        job_serializer=arq_serialize,
        job_deserializer=arq_deserialize,
        log_results=False,
    )
    worker.mark = mark
    if settings.idle_poll_s > 0:
        worker.bell = QueueBell(arq, keys.queue(name), settings.idle_poll_s)
    log.info("worker %s serving %s (max_batch=%d)", wid, name, backend.max_batch)
    if settings.metrics_port:
        try:
            wc.metrics.serve(settings.host, settings.metrics_port)
        except OSError as exc:  # a taken port must not keep the model from serving
            log.warning("metrics endpoint on port %d failed: %s", settings.metrics_port, exc)
    return RunningWorker(wc, arq, worker)


def run_worker(settings: Settings, model_spec: str, name: str | None) -> int:
    """Serve ``model_spec`` until SIGTERM/SIGINT; exit code 2 when the model cannot load."""
    logs.configure(settings)
    try:
        backend = load_backend(settings, model_spec, name)
    except Exception as exc:  # one clear line for the operator, no traceback
        print(f"sluice worker: cannot load model {model_spec!r}: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(settings, backend))


async def _serve(settings: Settings, backend: Backend) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if not await _wait_for_redis(settings, stop):
        return 0  # told to stop before Redis ever answered
    try:
        running = await start_worker(settings, backend)
    except RedisError as exc:
        url = settings.events_redis_url
        print(f"sluice worker: cannot reach Redis at {url}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the backend's start-up (e.g. loading weights) failed
        print(f"sluice worker: cannot start model {backend.card.name!r}: {exc}", file=sys.stderr)
        return 2
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({stopper, running.main_task}, return_when=asyncio.FIRST_COMPLETED)
    crashed = running.main_task.done() and not stop.is_set()
    if crashed and (failure := running.main_task.exception()) is not None:
        print(f"sluice worker: arq worker stopped: {failure}", file=sys.stderr)
    stopper.cancel()
    await running.stop()
    return 1 if crashed else 0


async def _wait_for_redis(settings: Settings, stop: asyncio.Event) -> bool:
    """Wait until the events Redis answers; False if ``stop`` is set first.

    A worker started before Redis (compose without health checks, a host reboot) or while it
    restarts waits with a capped backoff instead of exiting: the model is loaded already, and an
    exit would leave the restart to a supervisor that may not exist.
    """
    url, backoff = settings.events_redis_url, Backoff(max_s=START_BACKOFF_MAX_S)
    while True:
        redis = redis_conn.client(url, socket_connect_timeout=CONNECT_TIMEOUT_S)
        started = time.monotonic()
        try:
            await redis.ping()
            return True
        except (RedisConnectionError, RedisTimeoutError) as exc:
            delay = backoff.failed(started)
            if backoff.log_due():
                log.warning("cannot reach Redis at %s (%s); retrying in %.2f s", url, exc, delay)
        finally:
            await redis.aclose()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
            return False
