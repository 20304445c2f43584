"""Retry pacing for the worker's queue poll while Redis is unreachable, and the poll's mark.

``Backoff`` spaces attempts by their *starts*: the wait after a failure is the delay minus the
time the failed attempt itself took (a connect that hung until its timeout, a poll that waited
for a doorbell). Sleeping the full delay after such an attempt made attempts come 3 s apart
while the log said 2 s. The cap is short (``POLL_BACKOFF_MAX_S``) so that a worker resumes within
half a second of Redis answering again; a refused connect costs next to nothing, so trying
twice a second through a long outage is cheap. Only the first failures and then one line every
``LOG_EVERY_S`` are logged, so a long outage does not flood the log.

``PollMark`` is what the poll loop tells the heartbeat: when the queue was last polled
successfully (published as the heartbeat's ``polled`` field, which ``/readyz`` compares with
Redis's start), and a nudge to beat at once after the first poll following a failure, so
readiness returns without waiting out a heartbeat period.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["LOG_EVERY_S", "POLL_BACKOFF_MAX_S", "POLL_BACKOFF_MIN_S", "Backoff", "PollMark"]

POLL_BACKOFF_MIN_S = 0.05  # first retry after a failed queue poll (Redis down or restarting)
POLL_BACKOFF_MAX_S = 0.5  # the longest gap between attempts: the worst-case reconnect delay
LOG_EVERY_S = 10.0  # once at the cap, one warning this often


class Backoff:
    """Capped exponential delays between attempt starts."""

    def __init__(
        self,
        first_s: float = POLL_BACKOFF_MIN_S,
        max_s: float = POLL_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Delays ``first_s``, doubling up to ``max_s``; ``clock`` is injectable for tests."""
        self.first_s, self.max_s, self._clock = first_s, max_s, clock
        self.delay_s = 0.0  # the gap before the next attempt's start; 0 while attempts succeed
        self.failures = 0  # consecutive failed attempts
        self._logged_at = -float("inf")

    def failed(self, started: float) -> float:
        """The attempt begun at ``started`` (this clock) failed: how long to wait from now so
        the next attempt starts ``delay_s`` after it."""
        self.failures += 1
        self.delay_s = min(max(self.delay_s * 2, self.first_s), self.max_s)
        return max(0.0, started + self.delay_s - self._clock())

    def log_due(self) -> bool:
        """Whether this failure should be logged: every one until the cap, then one a while."""
        now = self._clock()
        if self.delay_s < self.max_s or now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            return True
        return False

    def succeeded(self) -> bool:
        """An attempt succeeded; returns whether attempts had been failing."""
        was_failing = self.failures > 0
        self.delay_s, self.failures, self._logged_at = 0.0, 0, -float("inf")
        return was_failing


class PollMark:
    """The last successful queue poll (epoch ms, this host's clock) and a beat-now nudge."""

    def __init__(self) -> None:
        """No poll yet."""
        self.polled_ms = 0
        self.beat_now = asyncio.Event()

    def polled(self, started_ms: int, *, urgent: bool) -> None:
        """A poll begun at ``started_ms`` succeeded; ``urgent``: publish it at once."""
        self.polled_ms = started_ms
        if urgent:
            self.beat_now.set()
