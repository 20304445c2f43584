"""One consumer's view of one hub stream: a cursor and a bounded buffer of the entries after it.

The hub's reader pushes entries (``_push``) and the consumer's task takes them in batches
(``get_batch``). This is the per-event path of every stream, so its waiting is as cheap as
asyncio allows: the consumer waits on one bare future, made only when the buffer is empty, and
woken once per hub read however many entries that read brought (not an ``asyncio.Event``, whose
``wait`` adds a waiter set and a future per call); and the wait's time limit (keepalives, the
start deadline, liveness checks) is one timer per subscription that is re-armed only when it
fires early, not a timer made and cancelled on every wait (the deadline moves forward with every
event, so a timer per wait meant a create and a cancel per event).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from services.api.stream_ids import StreamId, parse_id

__all__ = ["Entry", "HubClosed", "Subscription", "SubscriptionFailed"]

Entry = tuple[str, dict[bytes, bytes]]  # (stream entry id, fields)

# A timer that fires this close before its deadline counts as on time (the loop's clock and
# its timers have millisecond resolution); re-arming for less would spin.
_SLACK_S = 0.001


class HubClosed(Exception):
    """The hub stopped while a subscriber was waiting."""


class SubscriptionFailed(HubClosed):
    """Redis refused to read this subscription's stream (e.g. the key is not a stream)."""


class _Hub(Protocol):
    high_water: int
    low_water: int

    async def wake(self) -> None: ...


class Subscription:
    """One consumer's view of one stream: a cursor and a bounded buffer of entries after it."""

    def __init__(self, hub: _Hub, key: str, after: str) -> None:
        """Create a subscription; use ``StreamHub.subscribe``, not this."""
        self.key = key
        self.cursor = after  # id of the last entry handed to the buffer
        self.cursor_id = parse_id(after)
        self.paused = False
        self.closed = False
        self.failure: SubscriptionFailed | None = None
        self._hub = hub
        self._buf: deque[Entry] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: float | None = None  # loop time at which the current wait gives up
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False  # the current wait's deadline passed

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _push(self, entry_id: str, parsed: StreamId, fields: dict[bytes, bytes]) -> None:
        self._buf.append((entry_id, fields))
        self.cursor, self.cursor_id = entry_id, parsed
        if len(self._buf) >= self._hub.high_water:
            self.paused = True
        self._wake()

    def _push_run(self, run: list[Entry], last: StreamId) -> None:
        """``_push`` each of ``run`` (ids ascending, all after the cursor; ``last`` is the id of
        its last entry, parsed): one cursor update and one wake-up for the lot."""
        room = self._hub.high_water - len(self._buf)
        if len(run) >= room:  # fills the buffer: take up to high water, and pause there
            run = run[: max(room, 1)]
            last = parse_id(run[-1][0])
            self.paused = True
        self._buf.extend(run)
        self.cursor, self.cursor_id = run[-1][0], last
        self._wake()

    def _close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None or self.closed:
            return
        loop = asyncio.get_running_loop()
        if loop.time() + _SLACK_S < deadline:  # the deadline moved on since it was armed
            self._timer = loop.call_at(deadline, self._on_timer)
            return
        self._expired = True
        self._wake()

    async def get(self, wait_s: float | None = None) -> Entry | None:
        """The next ``(entry_id, fields)``, or None when ``wait_s`` (None: forever) passed first.

        Raises:
            HubClosed: the hub stopped (``SubscriptionFailed``: Redis refused this stream).
        """
        batch = await self.get_batch(wait_s, limit=1)
        return batch[0] if batch else None

    async def _wait(self, wait_s: float | None) -> None:
        """Wait until an entry is buffered, the hub closes (``HubClosed``) or ``wait_s`` passes."""
        loop = asyncio.get_running_loop()
        self._expired = False
        deadline = None
        if wait_s is not None:
            deadline = loop.time() + wait_s
            timer = self._timer
            if timer is None or timer.when() > deadline + _SLACK_S:
                if timer is not None:
                    timer.cancel()
                self._timer = loop.call_at(deadline, self._on_timer)
        self._deadline = deadline
        try:
            while not self._buf:
                if self.closed:
                    raise self.failure or HubClosed("stream hub stopped")
                if self._expired:
                    return
                self._waiter = loop.create_future()
                await self._waiter
        finally:
            self._waiter = None
            self._deadline = None

    async def get_batch(self, wait_s: float | None = None, limit: int = 64) -> list[Entry]:
        """Wait for entries, then take every buffered one (up to ``limit``).

        A consumer that fell behind catches up in one write instead of one per entry, so an
        overloaded process sheds syscalls exactly when it needs to.

        Args:
            wait_s: seconds to wait; None waits forever.
            limit: the most entries to return.

        Returns:
            At least one entry, or an empty list when ``wait_s`` passed without one.

        Raises:
            HubClosed: the hub stopped.
        """
        if not self._buf:
            await self._wait(wait_s)
            if not self._buf:
                return []
        buf = self._buf
        if len(buf) <= limit:  # the usual case: take everything without a per-item pop
            items = list(buf)
            buf.clear()
        else:
            items = [buf.popleft() for _ in range(limit)]
        if self.paused and len(buf) <= self._hub.low_water:
            self.paused = False
            await self._hub.wake()
        return items
