"""Worker start-up: load a backend, publish its card, consume the queue, run the background loops.

``run_worker`` is what ``sluice worker`` calls. ``start_worker`` starts everything as tasks on
the running event loop and returns a ``RunningWorker`` (the test harness uses it directly). The
queue's consumption (arq, its doorbell, its poll backoff) is ``services.queue.Consumer``.
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
from collections import deque
from typing import Any

import msgspec
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
    RedisError,
    TimeoutError as RedisTimeoutError,
)

from services import redis_conn
from services.queue.consumer import Consumer
from services.queue.poll_backoff import Backoff, PollMark
from services.worker.backend import Backend
from services.worker.heartbeat import VERSION, beat_once, device_of, heartbeat_loop, retire
from services.worker.job_function import WorkerContext, generate
from services.worker.publish_pipe import PublishPipe
from services.worker.recovery import sweep_loop
from shared import keys, logs
from shared.config import Settings
from shared.model_card import encode_card
from shared.protocol import Scripts

__all__ = [
    "SHUTDOWN_GRACE_S",
    "RunningWorker",
    "load_backend",
    "run_worker",
    "start_worker",
]

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # SIGTERM: let in-flight requests finish this long, then hand them over
START_BACKOFF_MAX_S = 1.0  # the longest wait between start-up attempts to reach Redis
# A connect that hangs (SYNs dropped while Redis's host or container restarts) gives up after
# this, so the next attempt's fresh SYN reaches Redis once it is back instead of waiting out the
# kernel's SYN retransmissions (1, 3, 7, 15 s...). Reaching a Redis takes milliseconds.
CONNECT_TIMEOUT_S = 1.0


def load_backend(settings: Settings, model_spec: str, name: str | None) -> Backend:
    """``scripted:...`` builds the test double; anything else loads a model through the engine."""
    if model_spec.startswith("scripted:") or model_spec == "scripted":
        from services.worker.scripted import parse_spec

        return parse_spec(model_spec, name)
    from services.worker.torch_backend import TorchBackend

    return TorchBackend.load(settings, model_spec, name)


class RunningWorker:
    """A started worker: the queue's consumer plus the heartbeat and recovery loops."""

    def __init__(self, wc: WorkerContext, consumer: Consumer, mark: PollMark) -> None:
        """Start the tasks (called by ``start_worker``)."""
        self.wc = wc
        self.consumer = consumer
        # Every line this worker's tasks log names it (several workers share a test process).
        ctx = contextvars.copy_context()
        ctx.run(logs.bind, worker=wc.wid, model=wc.name)
        self.main_task = asyncio.create_task(
            consumer.run(), name=f"arq-{wc.wid}", context=ctx.copy()
        )
        self._loops = [
            asyncio.create_task(
                heartbeat_loop(wc, mark), name=f"beat-{wc.wid}", context=ctx.copy()
            ),
            asyncio.create_task(
                sweep_loop(wc, consumer.queue), name=f"sweep-{wc.wid}", context=ctx.copy()
            ),
        ]
        for loop in consumer.background():
            self._loops.append(asyncio.create_task(loop, name=f"bell-{wc.wid}", context=ctx.copy()))
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
        self.consumer.stop_taking()
        running = self.consumer.running()
        if running:
            await asyncio.wait(running, timeout=grace_s)
        self.wc.stopping = True
        await self._cancel_all()
        with contextlib.suppress(Exception):
            await retire(self.wc)
            await self.consumer.retire()
        await self._close()

    async def kill(self) -> None:
        """Hard kill, as SIGKILL would: no terminal events, leases left to expire, no goodbye."""
        if self._closed:
            return
        self.wc.killed = True
        await self._cancel_all()
        await self._close()

    async def _cancel_all(self) -> None:
        tasks = self.consumer.running()
        for t in [*tasks, self.main_task, *self._loops]:
            t.cancel()
        await asyncio.gather(*tasks, self.main_task, *self._loops, return_exceptions=True)

    async def _close(self) -> None:
        self._closed = True
        self.wc.metrics.close()
        await self.consumer.aclose()
        if self.wc.pipe is not None:
            await self.wc.pipe.aclose()
        await self.wc.redis.aclose()
        await self.wc.backend.stop()


async def start_worker(
    settings: Settings, backend: Backend, *, wid: str | None = None
) -> RunningWorker:
    """Start a worker for ``backend`` on the running loop: card, heartbeat, queue, sweeper."""
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
    consumer = Consumer(
        redis_conn.queue_client_url(settings.queue_redis_url),
        name,
        lambda payload: generate(wc, payload),
        max_jobs=backend.max_batch,
        poll_delay_s=settings.poll_delay_s,
        idle_poll_s=settings.idle_poll_s,
        health_key=f"{keys.worker(wid)}:arq",
        connect_timeout_s=CONNECT_TIMEOUT_S,
        mark=mark,
        **_affinity(settings, backend, wc),
    )
    wc.queue = consumer.queue  # the sweeper's repairs
    log.info("worker %s serving %s (max_batch=%d)", wid, name, backend.max_batch)
    if settings.metrics_port:
        try:
            wc.metrics.serve(settings.host, settings.metrics_port)
        except OSError as exc:  # a taken port must not keep the model from serving
            log.warning("metrics endpoint on port %d failed: %s", settings.metrics_port, exc)
    return RunningWorker(wc, consumer, mark)


def _affinity(settings: Settings, backend: Backend, wc: WorkerContext) -> dict[str, Any]:
    """The consumer's cache-aware pickup (``services/queue/affinity.py``), unless it is off: it
    publishes what the prefix cache holds from the block pool's journal (a backend without a
    paged cache publishes its free slots only) and counts each pickup's outcome."""
    if settings.affinity_wait_ms <= 0:
        return {}
    journal: deque[tuple[bool, bytes]] | None = None
    scheduler = getattr(backend, "scheduler", None)
    if scheduler is not None:
        journal = scheduler.planner.pool.journal = deque()
    return {
        "affinity_wid": wc.wid,
        "journal": journal,
        "on_pickup": wc.metrics.pickups(wc.name),
    }


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
