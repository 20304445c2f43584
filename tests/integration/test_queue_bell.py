"""The queue's doorbell against real Redis: a worker picks a job up when it is queued, not at its
next poll, polls an idle queue once per ``SLUICE_IDLE_POLL_S``, and falls back to polling while
its subscription is lost."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from services.queue.consumer import OwnJobsWorker
from shared.events import Finish
from tests.integration.test_worker_bus import make_job, read_stream, submit
from tests.integration.worker_harness import WorkerHandle, running_worker

pytestmark = pytest.mark.integration

LONG_IDLE = {"idle_poll_s": 60.0}  # a job picked up in a test's time was rung, not polled for


def _arq_worker(handle: WorkerHandle) -> OwnJobsWorker:
    worker = handle.running.consumer.worker
    assert isinstance(worker, OwnJobsWorker) and worker.bell is not None
    return worker


async def _until(check: Callable[[], bool], seconds: float = 10) -> None:
    async with asyncio.timeout(seconds):
        while not check():  # noqa: ASYNC110  # a flag of the worker's, no event to wait on
            await asyncio.sleep(0.01)


async def test_a_queued_job_rings_the_worker(redis_url: str, redis: aioredis.Redis) -> None:
    async with running_worker(redis_url, settings_overrides=LONG_IDLE) as handle:
        worker = _arq_worker(handle)
        await _until(lambda: worker.bell is not None and worker.bell.listening)
        await asyncio.sleep(0.05)  # the poll the subscription itself triggers
        polls = worker.polls
        assert await submit(redis_url, make_job("rang-1", handle.name))
        events = await read_stream(redis, "rang-1")
        assert isinstance(events[-1], Finish)
        assert worker.bell is not None and worker.bell.rings >= 1
        # one poll for the ring, and at most one more for the job's end (a freed slot)
        assert worker.polls - polls <= 2


async def test_an_idle_worker_polls_once_per_idle_interval(redis_url: str) -> None:
    """With the doorbell, an idle worker's polls are an idle interval apart; without it, it
    polls on its own. Gaps are checked from below only (a loaded machine only widens them), so
    a worker that polls without waiting for the bell fails however slow the machine is."""
    idle_s = 0.25
    async with running_worker(redis_url, settings_overrides={"idle_poll_s": idle_s}) as rung:
        worker = _arq_worker(rung)
        bell = worker.bell
        assert bell is not None
        await _until(lambda: bell.listening)
        polled_at: list[float] = []
        inner = bell.wait

        async def timed_wait() -> None:
            await inner()
            polled_at.append(time.monotonic())

        bell.wait = timed_wait  # type: ignore[method-assign]
        await _until(lambda: len(polled_at) >= 4)
    # the first wait may end at once (the subscription's own ring); the next ones are idle
    gaps = [b - a for a, b in itertools.pairwise(polled_at[1:])]
    assert gaps and min(gaps) >= idle_s - 0.01  # timers may fire up to a clock tick early
    async with running_worker(redis_url, settings_overrides={"idle_poll_s": 0}) as plain:
        assert plain.running.consumer.worker.bell is None
        before = plain.running.consumer.worker.polls
        await _until(lambda: plain.running.consumer.worker.polls >= before + 3)


async def test_a_lost_subscription_polls_until_it_is_back(
    redis_url: str, redis: aioredis.Redis
) -> None:
    async with running_worker(redis_url, settings_overrides=LONG_IDLE) as handle:
        worker = _arq_worker(handle)
        bell = worker.bell
        assert bell is not None
        await _until(lambda: bell.listening)
        await redis.client_kill_filter(_type="pubsub")
        await _until(lambda: not bell.listening)
        await _until(lambda: bell.listening)  # re-subscribed after a short backoff
        assert await submit(redis_url, make_job("after-loss", handle.name))
        assert isinstance((await read_stream(redis, "after-loss"))[-1], Finish)


async def test_a_ring_from_a_clock_ahead_is_rung_again_when_due(
    redis_url: str, redis: aioredis.Redis
) -> None:
    """arq skips a job whose score is past the worker's clock; the ring carries the score, so
    the worker polls again once its clock gets there rather than after the idle interval."""
    async with running_worker(redis_url, settings_overrides=LONG_IDLE) as handle:
        worker = _arq_worker(handle)
        await _until(lambda: worker.bell is not None and worker.bell.listening)
        ahead = int(time.time() * 1000) + 400
        assert await submit(redis_url, make_job("ahead", handle.name), enqueue_ms=ahead)
        events = await read_stream(redis, "ahead")
        assert isinstance(events[-1], Finish)
        assert time.time() * 1000 >= ahead
