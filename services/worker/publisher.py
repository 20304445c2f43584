"""Appending a request's events to its Redis stream, fenced by the request lease.

The publisher owns the write side of ``sluice:events:{rid}``: every batch (what one decode step
produced for this sequence) goes out as one call of the protocol's ``PUBLISH`` script
(``shared.protocol``; in the worker, pipelined with the other sequences' calls of the same step
by ``PublishPipe``), which (1) checks that this worker still holds ``sluice:lease:{rid}``
(re-taking it if it merely expired), (2) XADDs the whole batch as ONE entry with ``MAXLEN ~
stream_maxlen`` (``Start`` + first text, last text + ``Usage`` + ``Finish``: one entry per step, not
per event), (3) sets the stream's TTL to the retention when asked (first write, terminal write, then
at most every ``TTL_REFRESH_S``: re-setting a TTL of hours on every token was two of the five
commands per entry), and (4) returns whether ``sluice:cancel:{rid}`` is set. Doing this atomically
is what keeps the stream a clean log when a stalled worker wakes up after another worker took its
request over: its late batch is refused instead of interleaving (fencing). Checking the cancel flag
in the same call costs nothing extra: the lease GET became an MGET of lease and flag, and no extra
round trip, and bounds cancellation latency to one decode step.

It also tracks the terminal event, so exactly one ``Finish``/``Error`` ever reaches the stream
(``ensure_terminal`` is the ``finally`` that guarantees one).

A Redis that reached ``maxmemory`` (``noeviction``) refuses the call's XADD, and the script
writes nothing (the XADD is its first write): the batch is still here, so ``publish`` pauses and
sends it again, backing off to ``_MAX_PAUSE_S``, until Redis takes it. A client sees a stall,
then the rest of its answer. After ``SLUICE_OOM_WAIT_S`` of refusals in a row it gives up: the
request's last entry is written by the same script flagged ``allow-oom`` (Redis 7), which Redis
runs past the limit: the held batch itself when it ends the answer, else a retryable
``Error(overloaded)``. One small entry per request given up, so the stream still ends with
exactly one terminal event and memory grows by a bounded amount; everything else waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from services.redis_oom import OOM_MESSAGE, is_oom
from services.worker.publish_pipe import PublishPipe
from shared import keys
from shared.codec import encode_events
from shared.config import Settings
from shared.events import AnyEvent, Error, is_terminal
from shared.protocol import LEASE_LOST, Scripts

__all__ = ["TTL_REFRESH_S", "Outcome", "Publisher"]

log = logging.getLogger(__name__)

# The stream's TTL (the retention, a day by default) is re-set at most this often while a
# request runs, so a generation of any length keeps its log, at one EXPIRE a minute instead
# of one per step. Capped at half the retention for short retentions.
TTL_REFRESH_S = 60.0

# Pauses between sends of a batch that a full Redis refused: short at first (memory is often
# freed within a moment, e.g. by an expiring stream), doubling up to a cap that keeps a
# recovered Redis from waiting long for the held events.
_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 0.5
# Runs the PUBLISH script even while Redis refuses writes; used only to end a request.
_ALLOW_OOM = "#!lua flags=allow-oom\n"


class Outcome(enum.Enum):
    """What a publish call learned besides "written"."""

    OK = "ok"
    CANCELLED = "cancelled"  # written, and the cancel flag is set: stop after this step
    LEASE_LOST = "lease_lost"  # not written: another worker owns the request now


class Publisher:
    """Writes one request's events; one instance per (request, attempt).

    ``owner`` is the lease value this publisher writes under (the worker id, or a sweeper's
    ``recovering:<wid>`` claim when it ends a request it could not hand over).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        rid: str,
        owner: str,
        settings: Settings,
        *,
        store: bool = True,
        pipe: PublishPipe | None = None,
    ) -> None:
        """Bind to the request's keys (``store``: the job's; False shortens its retention;
        ``pipe``: the worker's, which sends a step's publishes together)."""
        self.redis = redis
        self._pipe = pipe
        self.rid = rid
        self.owner = owner
        self._scripts = Scripts(redis)
        self._oom_wait_s = settings.oom_wait_s
        self._lease_ms = int(settings.lease_ttl_s * 1000)
        self._maxlen = settings.stream_maxlen
        self._retention_s = settings.retention_s
        # store: false keeps the full retention while the request runs (a queue wait or a long
        # prefill must not expire its log), and only the terminal batch cuts the stream and the
        # request hash down to the resume window, atomically with writing the terminal event.
        self._end_retention_s = settings.retention_s if store else settings.unstored_retention_s
        self._end_expire = () if store else (keys.request(rid),)
        self._ttl_every_s = min(TTL_REFRESH_S, settings.retention_s / 2)
        self._ttl_set_at: float | None = None  # monotonic time of the last TTL write
        self.terminal: AnyEvent | None = None
        self.lease_lost = False
        self.published = 0

    async def publish(self, events: Sequence[AnyEvent]) -> Outcome:
        """Append ``events`` (one step's worth) as one stream entry, in one round trip.

        An empty step writes nothing (an entry always holds at least one event).

        Cancellation waits for a call already sent, so ``terminal`` always tells the truth about
        the stream (a shutdown that interrupted a terminal write must not add a second one).

        Raises:
            RuntimeError: a terminal event was already published (a caller bug).
        """
        if self.terminal is not None:
            raise RuntimeError(f"{self.rid}: publish after the terminal event")
        if self.lease_lost:
            return Outcome.LEASE_LOST
        if not events:
            return Outcome.OK
        refused_since: float | None = None
        pause = _FIRST_PAUSE_S
        while True:
            try:
                return await self._send(events)
            except ResponseError as exc:
                if not is_oom(exc):
                    raise
                now = time.monotonic()
                if refused_since is None:
                    refused_since = now
                    log.warning("%s: Redis is out of memory; holding the events", self.rid)
                if now - refused_since >= self._oom_wait_s:
                    return await self._give_up(events)
            # Cancellable (unlike a send): nothing is in flight while paused.
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_S)

    async def _send(self, events: Sequence[AnyEvent], *, allow_oom: bool = False) -> Outcome:
        write = asyncio.ensure_future(self._write(events, allow_oom=allow_oom))
        try:
            return await asyncio.shield(write)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await write
            raise

    async def _give_up(self, events: Sequence[AnyEvent]) -> Outcome:
        """End the request past the memory limit: ``events`` if they end it, else an Error."""
        log.error("%s: Redis refused writes for %.0f s; ending the request", self.rid,
                  self._oom_wait_s)  # fmt: skip
        if not any(is_terminal(e) for e in events):
            events = [Error(kind="overloaded", message=OOM_MESSAGE, retryable=True)]
        return await self._send(events, allow_oom=True)

    def _ttl(self, ends: bool) -> int:
        """The TTL this write sets (0: leave it): first write, terminal write, then a refresh."""
        if ends:
            return self._end_retention_s
        now = time.monotonic()
        if self._ttl_set_at is None or now - self._ttl_set_at >= self._ttl_every_s:
            return self._retention_s
        return 0

    async def _write(self, events: Sequence[AnyEvent], *, allow_oom: bool = False) -> Outcome:
        ends = any(is_terminal(e) for e in events)
        ttl = self._ttl(ends)
        keys_, args = Scripts.publish_call(
            self.rid, self.owner, encode_events(events), lease_ms=self._lease_ms,
            maxlen=self._maxlen, retention_s=ttl, also_expire=self._end_expire if ends else (),
        )  # fmt: skip
        if allow_oom:  # rare (one call per request given up): not worth a registered script
            source = _ALLOW_OOM + self._scripts.publish_source
            result = int(await self.redis.eval(source, len(keys_), *keys_, *args))  # type: ignore[misc]
        elif self._pipe is None:
            result = await self._scripts.publish(keys_, args)
        else:
            result = int(await self._pipe.call(keys_, args))
        if ttl and result != LEASE_LOST:
            self._ttl_set_at = time.monotonic()
        if result == LEASE_LOST:
            self.lease_lost = True
            log.warning("%s: lease taken over by another worker; stopping", self.rid)
            return Outcome.LEASE_LOST
        self.published += len(events)
        terminals = [e for e in events if is_terminal(e)]
        if terminals:
            self.terminal = terminals[-1]
        return Outcome.CANCELLED if result == 1 else Outcome.OK

    async def ensure_terminal(self, make: Callable[[], Sequence[AnyEvent]]) -> bool:
        """Publish ``make()`` unless a terminal is out or the lease is lost; True if published."""
        if self.terminal is not None or self.lease_lost:
            return False
        await self.publish(make())
        return self.terminal is not None

    async def acquire(self) -> bool:
        """Take the lease for this owner (False: another live worker holds it)."""
        return await self._scripts.acquire(self.rid, self.owner, self._lease_ms)

    async def queue_acquire(self, pipe: Pipeline) -> None:
        """Queue ``acquire`` on a pipeline (its reply is 1 when taken, 0 when not)."""
        await self._scripts.queue_acquire(pipe, self.rid, self.owner, self._lease_ms)

    async def release(self) -> None:
        """Drop the lease if this owner still holds it."""
        await self._scripts.release(self.rid, self.owner)
