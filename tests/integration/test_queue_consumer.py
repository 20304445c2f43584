"""The worker's side of the queue (``services.queue.Consumer``) on a real Redis: jobs are taken
by free slots, oldest first, each run once, and none after ``stop_taking``.

The handler holds each job until the test releases it, so what "running" means is decided by
the test, not by a timer: the consumer may never run more jobs than it has slots.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from services.queue import Queue
from services.queue.consumer import Consumer

pytestmark = pytest.mark.integration

MODEL = "consumer-test"


class Held:
    """A handler whose jobs run until released, recording what ran at once."""

    def __init__(self) -> None:
        self.started: list[bytes] = []
        self.finished: list[bytes] = []
        self.running = 0
        self.most = 0
        self.gates: dict[bytes, asyncio.Event] = {}
        self.changed = asyncio.Condition()

    async def __call__(self, payload: bytes) -> None:
        gate = self.gates.setdefault(payload, asyncio.Event())
        async with self.changed:
            self.started.append(payload)
            self.running += 1
            self.most = max(self.most, self.running)
            self.changed.notify_all()
        await gate.wait()
        async with self.changed:
            self.running -= 1
            self.finished.append(payload)
            self.changed.notify_all()

    async def until(self, started: int = 0, finished: int = 0) -> None:
        async with self.changed:
            await asyncio.wait_for(
                self.changed.wait_for(
                    lambda: len(self.started) >= started and len(self.finished) >= finished
                ),
                timeout=10,
            )

    def release(self, payload: bytes) -> None:
        self.gates.setdefault(payload, asyncio.Event()).set()


async def enqueue(redis: aioredis.Redis, ids: list[str]) -> None:
    queue = Queue(redis)
    now_ms = int(time.time() * 1000)
    for i, jid in enumerate(ids):
        payload = jid.encode()
        await queue.enqueue(
            MODEL, jid, payload, enqueue_ms=now_ms + i, expires_ms=60_000, bound=100
        )


async def test_jobs_are_taken_by_free_slots_oldest_first(
    redis: aioredis.Redis, redis_url: str
) -> None:
    held = Held()
    consumer = Consumer(
        redis_url,
        MODEL,
        held,
        max_jobs=2,
        poll_delay_s=0.01,
        idle_poll_s=0.5,
        health_key="arq:health-check:consumer-test",
        connect_timeout_s=2.0,
    )
    ids = [f"job-{i}" for i in range(5)]
    await enqueue(redis, ids)
    tasks = [asyncio.create_task(c) for c in (consumer.run(), *consumer.background())]
    try:
        await held.until(started=2)
        assert held.started == [b"job-0", b"job-1"]  # the two oldest, into the two slots
        held.release(b"job-1")
        await held.until(started=3, finished=1)
        assert held.started[2] == b"job-2"  # the freed slot takes the next oldest
        assert len(consumer.running()) == 2
        consumer.stop_taking()
        for jid in (b"job-0", b"job-2"):
            held.release(jid)
        await held.until(finished=3)
        assert held.started == [b"job-0", b"job-1", b"job-2"]  # none taken after stop_taking
        assert held.most == 2
        # arq takes a finished job out of the queue just after its handler returns
        waiting: list[str] = []
        for _ in range(200):
            waiting = [jid for jid, _ in await Queue(redis).waiting(MODEL)]
            if waiting == ["job-3", "job-4"]:
                break
            await asyncio.sleep(0.05)
        assert waiting == ["job-3", "job-4"]  # still queued, for another worker
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await consumer.aclose()
