"""The queue's doorbell: a worker polls arq's queue when a job arrives, not 100 times a second.

``ENQUEUE_BOUNDED`` (``client.Queue.enqueue``), the one way jobs enter a model's queue,
publishes each queued job's score on a channel named like the queue. A worker subscribes, and
its arq poll loop (``consumer.OwnJobsWorker``) waits before each poll for a ring, for
one of its own jobs to end (a slot a waiting job can take), or for ``SLUICE_IDLE_POLL_S`` at
most: a ring lost with a dropped subscription delays a pickup by that much, never forever. While
it is not subscribed (starting, or the subscription failed), it polls every
``SLUICE_POLL_DELAY_S`` as plain arq does.

Why: at one stream, arq's polls were ~40 % of the worker's event-loop CPU (py-spy), and a
poll's Python, socket and Redis work lands on the cores the model decodes on, where every
preemption of a kernel thread stalls the step at its next barrier. Pickup latency is the ring's
delivery (one Redis hop) instead of half a poll interval.

The ring carries the job's score (the enqueuer's clock, in ms): arq only takes jobs whose score
is at most the worker's clock, so a job rung from a clock running ahead is rung again here once
this clock reaches its score instead of waiting out the idle poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

__all__ = ["QueueBell"]

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.05  # first re-subscribe after a failure
BACKOFF_MAX_S = 0.5  # as the poll's (poll_backoff.py): back within half a second of Redis
EARLY_RING_MAX_S = 5.0  # a score further ahead than this is not waited for: the idle poll is


class QueueBell:
    """Rings for one queue: ``wait`` returns when a poll is due."""

    def __init__(self, client: aioredis.Redis, channel: str, idle_s: float) -> None:
        self._client, self.channel, self.idle_s = client, channel, idle_s
        self._rung = asyncio.Event()
        self.listening = False  # subscribed: polls wait for rings
        self.rings = 0  # messages received

    def ring(self) -> None:
        """A poll is due now (a job of this worker ended: its slot is free)."""
        self._rung.set()

    async def wait(self) -> None:
        """Return when the next poll is due: at once while not subscribed (arq's own loop then
        spaces polls by its poll delay), else at a ring or after ``idle_s``."""
        if self.listening and not self._rung.is_set():
            # asyncio.timeout, not wait_for: wait_for returns normally when it is cancelled just
            # as the event is set (the listener's last act when the worker stops), and arq's
            # loop would then never end
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.idle_s):
                    await self._rung.wait()
        self._rung.clear()

    def _heard(self, data: bytes | str) -> None:
        self.rings += 1
        self._rung.set()
        try:
            ahead_s = (float(data) - time.time() * 1000) / 1000
        except ValueError:
            return
        if 0 < ahead_s <= EARLY_RING_MAX_S:  # arq would skip it until this clock gets there
            asyncio.get_running_loop().call_later(ahead_s + 0.001, self._rung.set)

    async def listen(self) -> None:
        """Keep a subscription to the channel (the worker runs this as a task until it stops),
        re-subscribing with a capped backoff after a failure."""
        delay = BACKOFF_MIN_S
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                self.listening = True
                self._rung.set()  # jobs queued before the subscription: one poll now
                delay = BACKOFF_MIN_S
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self._heard(message["data"])
            except (RedisError, OSError) as exc:
                log.warning("queue doorbell %s lost (%s); polling meanwhile", self.channel, exc)
            finally:
                self.listening = False
                self._rung.set()
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
