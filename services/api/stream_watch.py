"""Deciding that a silent stream will never end by itself, so its client is not left waiting.

A tail normally ends at the stream's terminal event. Two things can take that event away for
good: Redis restarting without persistence (the request hash, the stream and the queue are
gone, so no worker will ever write to it again), and a stream whose writer vanished without
anyone taking it over (no lease, no new entry). While a tail is silent it asks Redis every
``check_s`` whether the request still exists and whether someone holds its lease; once the log
is gone, or nobody has held the lease (or Redis has not answered) for longer than the lease TTL
plus a margin, the tail ends with ``StreamLost``, which streaming routes send as a retryable
in-band error in the client's format and non-streaming ones as a 503 with Retry-After.

A request that has not started yet is left to the start timeout (``start_timeout``), except
that a vanished request record ends it at once: nothing will ever start it.
"""

from __future__ import annotations

import time

from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeout

from services.api.state import AppState
from shared import keys
from shared.errors import Unavailable

__all__ = ["StreamLost", "StreamWatch"]

# Beyond the lease TTL: a sweeper takes a lost request over within a heartbeat or two.
_MARGIN_BEATS = 3
_MIN_MARGIN_S = 1.0


class StreamLost(Unavailable):
    """A request's stream can no longer end with its own terminal event; retry the request."""


class StreamWatch:
    """The liveness check of one tail; ``check`` raises ``StreamLost`` when it is hopeless."""

    def __init__(self, state: AppState, rid: str, *, started: bool) -> None:
        """Watch ``rid``; ``started`` when the client already saw entries of its stream."""
        settings = state.settings
        self._state = state
        self._rid = rid
        self.started = started
        margin = max(_MARGIN_BEATS * settings.heartbeat_s, _MIN_MARGIN_S)
        self.limit_s = settings.lease_ttl_s + margin
        self.check_s = max(min(settings.lease_ttl_s / 2, settings.keepalive_s), 0.05)
        self._orphan_since: float | None = None

    def alive(self) -> None:
        """An entry arrived: the stream is being written."""
        self.started = True
        self._orphan_since = None

    async def check(self) -> None:
        """Look at the request's keys once.

        Raises:
            StreamLost: the log is gone, or it has been unattended longer than ``limit_s``.
        """
        rid = self._rid
        try:
            async with self._state.redis.pipeline(transaction=False) as pipe:
                pipe.exists(keys.request(rid))
                pipe.exists(keys.events(rid))
                pipe.exists(keys.lease(rid))
                has_request, has_events, leased = await pipe.execute()
        except (RedisConnectionError, RedisTimeout, OSError):
            why = "the event store has not answered"
        else:
            if not has_request or (self.started and not has_events):
                raise StreamLost(
                    "this request's event log was lost (the event store restarted without"
                    " its data); send the request again",
                    retry_after=1,
                )
            if leased or not self.started:
                self._orphan_since = None
                return
            why = "no worker has been generating this request"
        now = time.monotonic()
        if self._orphan_since is None:
            self._orphan_since = now
        elif now - self._orphan_since >= self.limit_s:
            raise StreamLost(f"{why} for {now - self._orphan_since:.0f} s", retry_after=1)
