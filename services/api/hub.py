"""The stream hub: one blocking XREAD per API process serves every live request stream.

A blocked XREAD holds its connection (Redis answers one command at a time per connection), so a
connection per SSE client would cost one Redis client per stream and one round trip per event.
Instead a single reader task runs ``XREAD BLOCK <ms> COUNT <n> STREAMS k1 … kN wake id1 … idN
wake_id`` with explicit last ids (never ``$``), and fans entries out to per-subscriber buffers. A
new subscription must not wait for the block to time out, so ``subscribe`` XADDs to the hub's
private wake stream, which is part of every call and makes the blocked XREAD return at once.

Back-pressure: a subscriber whose buffer passes ``high_water`` is paused; its key drops out of the
XREAD (unless another subscriber of the same key is keeping up) and its cursor stays where it was,
so a slow client costs nothing but its own buffer and never stalls anyone else. When it drains
below ``low_water`` it resumes from its cursor. Because the stream is a durable log, a lost Redis
connection is retried from the same (explicit) cursors without losing or repeating entries. A
key Redis refuses (it fails the whole XREAD) fails and drops only its own subscriptions. This
module owns no key names beyond the wake stream and never decodes events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
    ResponseError,
    TimeoutError as RedisTimeout,
)

from services.api.stream_ids import StreamId, parse_id
from services.api.subscription import Entry, HubClosed, Subscription, SubscriptionFailed
from services.api.xread_wire import XRead
from shared import keys

__all__ = ["Entry", "HubClosed", "StreamHub", "Subscription", "SubscriptionFailed", "parse_id"]

logger = logging.getLogger(__name__)


def _parse(raw_id: bytes) -> StreamId:
    ms, _, seq = raw_id.partition(b"-")
    return int(ms), int(seq)


def _fields(flat: list[bytes] | None) -> dict[bytes, bytes]:
    # Event entries have exactly two fields (v, e); build that dict without zip/iter.
    if flat is None:  # an entry deleted under a pending read carries no fields
        return {}
    if len(flat) == 4:
        return {flat[0]: flat[1], flat[2]: flat[3]}
    it = iter(flat)
    return dict(zip(it, it, strict=True))


class StreamHub:
    """Multiplexes many XREAD tails over one dedicated blocking connection."""

    def __init__(
        self,
        redis_url: str,
        commands: aioredis.Redis,
        *,
        block_ms: int = 5_000,
        count: int = 256,
        high_water: int = 1_024,
    ) -> None:
        """Configure the hub; ``start()`` opens the connection.

        Args:
            redis_url: where the blocking connection goes.
            commands: the app's ordinary client, used for the wake XADD (never for blocking).
            block_ms: XREAD BLOCK time; only bounds how long an idle hub sleeps.
            count: XREAD COUNT per stream per call.
            high_water: buffered entries at which a subscriber is paused (resumes at a quarter).
        """
        self.redis_url = redis_url
        self.block_ms = block_ms
        self.count = count
        self.high_water = high_water
        self.low_water = high_water // 4
        self.wake_key = keys.hub_wake(f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self._commands = commands
        self._conn: aioredis.Redis | None = None
        self._xread = XRead(count, block_ms)
        self._task: asyncio.Task[None] | None = None
        self._subs: dict[str, list[Subscription]] = {}
        self._wake_id = "0-0"
        self._version = 0  # bumped whenever the set of keys/cursors to read changes
        self._inflight_version = -1  # the version the pending XREAD was built from
        self._woken_version = -1
        self._stopping = False
        self.xread_calls = 0
        self.on_read: Callable[[int], None] = lambda entries: None  # entries per XREAD (metrics)

    @property
    def subscriptions(self) -> int:
        """How many subscriptions are open."""
        return sum(len(v) for v in self._subs.values())

    def watching(self, key: str) -> bool:
        """Whether any subscription to ``key`` is open in this process."""
        return key in self._subs

    def _connect(self) -> aioredis.Redis:
        # socket_timeout must exceed the block time or redis-py raises TimeoutError while the
        # server is legitimately blocking (redis/redis-py#3138).
        conn: aioredis.Redis = aioredis.Redis.from_url(
            self.redis_url,
            single_connection_client=True,
            socket_timeout=self.block_ms / 1000 + 10,
            socket_connect_timeout=5,
            client_name="sluice-hub",
        )
        return conn

    async def _reconnect(self) -> None:
        # A connection that failed in an unexpected way may be mid-reply: never reuse it.
        old, self._conn = self._conn, self._connect()
        if old is not None:
            with contextlib.suppress(Exception):
                await old.aclose()

    async def start(self) -> None:
        """Open the blocking connection and start the reader task."""
        self._conn = self._connect()
        self._task = asyncio.create_task(self._run(), name="sluice-stream-hub")

    async def stop(self) -> None:
        """Stop the reader, close the connection and wake every subscriber with ``HubClosed``."""
        self._stopping = True
        if self._task is not None:
            # Cancelling a blocked read is not reliable in redis-py 5 (the cancellation can be
            # absorbed while the single connection waits out its socket timeout), so the reader
            # is asked to leave through its own wake stream first and only then cancelled.
            with contextlib.suppress(Exception):
                await self._xadd_wake()
            done, _ = await asyncio.wait({self._task}, timeout=2)
            if not done:
                self._task.cancel()
                if self._conn is not None:
                    await self._conn.aclose()
                await asyncio.wait({self._task}, timeout=2)
            if self._task.done() and not self._task.cancelled():
                self._task.exception()  # retrieved: a failure while stopping is not news
            self._task = None
        for subs in self._subs.values():
            for sub in subs:
                sub._close()
        self._subs.clear()
        if self._conn is not None:
            await self._conn.aclose()
            self._conn = None
        with contextlib.suppress(Exception):
            await self._commands.delete(self.wake_key)

    async def subscribe(self, key: str, after: str = "0-0") -> Subscription:
        """Start receiving entries of ``key`` with ids greater than ``after``.

        Args:
            key: the stream key.
            after: the last id already seen (``0-0`` for the whole stream); a ``ValueError`` if
                it is not a stream id (``stream_ids.parse_id``).

        Returns:
            The subscription; pass it to ``unsubscribe`` when done.
        """
        sub = Subscription(self, key, after)
        self._subs.setdefault(key, []).append(sub)
        await self.wake()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop delivering to ``sub`` (idempotent; no Redis call)."""
        subs = self._subs.get(sub.key)
        if subs and sub in subs:
            subs.remove(sub)
            if not subs:
                del self._subs[sub.key]
            self._version += 1
        sub._close()

    @contextlib.asynccontextmanager
    async def subscription(self, key: str, after: str = "0-0") -> AsyncIterator[Subscription]:
        """``subscribe`` as a context manager; it unsubscribes even if cancelled in ``wake``."""
        sub = Subscription(self, key, after)
        self._subs.setdefault(key, []).append(sub)
        try:
            await self.wake()
            yield sub
        finally:
            self.unsubscribe(sub)

    async def wake(self) -> None:
        """Make the reader re-issue its XREAD soon if the pending one predates a change."""
        self._version += 1
        if self._inflight_version < 0 or self._woken_version == self._inflight_version:
            return  # no XREAD pending, or it is already being woken
        self._woken_version = self._inflight_version
        await self._xadd_wake()

    async def _xadd_wake(self) -> None:
        async with self._commands.pipeline(transaction=False) as pipe:
            pipe.xadd(self.wake_key, {b"w": b"1"}, maxlen=16, approximate=True)
            pipe.expire(self.wake_key, 3_600)
            await pipe.execute()

    def _streams(self) -> dict[str, str]:
        streams: dict[str, str] = {}
        for key, subs in self._subs.items():
            best: Subscription | None = None
            for sub in subs:
                if not sub.paused and (best is None or sub.cursor_id < best.cursor_id):
                    best = sub
            if best is not None:
                streams[key] = best.cursor
        streams[self.wake_key] = self._wake_id
        return streams

    def _dispatch(self, response: list[list[Any]]) -> None:
        """Fan a raw RESP2 XREAD reply (``[[key, [[id, [f, v, …]], …]], …]``) out to subscribers."""
        for raw_key, entries in response:
            key = raw_key.decode()
            if key == self.wake_key:
                self._wake_id = entries[-1][0].decode()
                continue
            subs = self._subs.get(key)
            if not subs:
                continue
            # Per entry only what every reader needs (its id as text, its fields); ids are
            # parsed as numbers only at the edges of the run, since they only grow.
            batch = [(raw_id.decode(), _fields(flat)) for raw_id, flat in entries]
            first = _parse(entries[0][0])
            last = first if len(entries) == 1 else _parse(entries[-1][0])
            for sub in subs:
                if sub.paused:
                    continue
                if sub.cursor_id < first:
                    sub._push_run(batch, last)
                    continue
                for (entry_id, fields), (raw_id, _) in zip(batch, entries, strict=True):
                    parsed = _parse(raw_id)  # ahead of the read cursor: skip what it has
                    if not sub.paused and sub.cursor_id < parsed:
                        sub._push(entry_id, parsed, fields)

    async def _isolate(self, streams: dict[str, str]) -> bool:
        """Fail the subscriptions whose stream Redis refuses on its own; True if any did."""
        found = False  # each key read alone, without BLOCK: returns at once
        for key, cursor in streams.items():
            try:
                await self._commands.xread({key: cursor}, count=1)
            except ResponseError as exc:
                self._fail(key, exc)
                found = True
        return found

    def _fail(self, key: str, exc: ResponseError) -> None:
        """End ``key``'s subscriptions with ``SubscriptionFailed``: Redis refuses to read it."""
        logger.warning("stream hub: dropping the subscriptions of %s: %s", key, exc)
        for sub in self._subs.pop(key, []):
            sub.failure = SubscriptionFailed(f"cannot read {key}: {exc}")
            sub._close()
        self._version += 1

    def _stopped(self) -> bool:  # a method, so the type checker does not narrow it in the loop
        return self._stopping

    async def _run(self) -> None:
        backoff = 0.05
        while not self._stopping:
            streams = self._streams()
            self._inflight_version = self._version
            assert self._conn is not None
            try:
                # The reply stays RESP2 nested lists: redis-py's own XREAD callback rebuilds
                # every entry into tuples and dicts first, about a third of the API's CPU.
                link = self._conn.connection or (await self._conn.initialize()).connection
                assert link is not None
                response: list[list[Any]] | None = await self._xread.call(link, streams)
            except Exception as exc:  # boundary: if this task died, every stream would hang
                self._inflight_version = -1
                if self._stopped():
                    return
                if isinstance(exc, ResponseError) and await self._isolate(streams):
                    continue  # Redis refused the whole call for one bad key; only it is dropped
                if isinstance(exc, RedisConnectionError | RedisTimeout | OSError):  # cursors kept
                    logger.warning("stream hub read failed (%s); retrying in %.2fs", exc, backoff)
                else:  # a connection that failed oddly may be mid-reply: replace it
                    logger.exception("stream hub reader failed; reconnecting in %.2fs", backoff)
                    await self._reconnect()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            finally:
                self.xread_calls += 1
            self._inflight_version = -1
            backoff = 0.05
            if response:
                self._dispatch(response)
                self.on_read(sum(len(entries) for _, entries in response))
