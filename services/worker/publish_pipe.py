"""One round trip per decode step: the ``PUBLISH`` calls of every running sequence in one pipeline.

Each running request's job coroutine publishes its own step batch (``Publisher``). The decode
thread hands a step's batches to the event loop together, so those coroutines wake and publish
in the same loop turn. Sent one by one, each call costs a round trip and redis-py's whole
per-command path, per sequence per step: at GPU batch sizes (hundreds of sequences, tens of
steps a second) that is thousands of commands a second of Python on the loop that also feeds
the decode thread. ``PublishPipe`` queues the calls made in one turn and sends them at the next
turn as one non-transactional pipeline of ``EVALSHA``: each call keeps its own reply or error
(a key Redis refuses fails only its own request), and a ``NOSCRIPT`` reply (a restarted Redis,
or on a cluster a primary whose script cache is empty) re-sends just those calls as ``EVAL``.
On a cluster, redis-py's pipeline splits the calls by node (one round trip per shard).

Knows nothing of events or leases: ``Scripts.publish_call`` spells the keys and arguments.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

__all__ = ["PublishPipe"]

Call = tuple[Sequence[str], Sequence[Any], "asyncio.Future[Any]"]


class PublishPipe:
    """Calls of one Lua script made in the same event-loop turn, sent as one pipeline."""

    def __init__(self, redis: aioredis.Redis, script: str) -> None:
        """Send ``script`` (its text, as ``Scripts.publish_source``) on ``redis``."""
        self.redis = redis
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()
        self._pending: list[Call] = []
        self._sending: set[asyncio.Task[None]] = set()  # strong references until done
        self.round_trips = 0  # pipelines sent (tests and benchmarks read it)

    async def call(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script with ``keys`` and ``args`` in the next pipeline; its reply.

        Raises:
            Whatever Redis answered for this call, or what stopped the pipeline (e.g. a
            ``ConnectionError``), as a direct call would.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:  # the first call of this turn: send them all at the next one
            loop.call_soon(self._flush)
        self._pending.append((keys, args, future))
        return await future

    def _flush(self) -> None:
        calls, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(calls))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[Call]) -> None:
        try:
            replies = await self._pipeline("EVALSHA", self.sha, calls)
            missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if missing:
                again = await self._pipeline("EVAL", self.script, [calls[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
        except BaseException as exc:  # the whole pipeline failed: so did each of its calls
            cancelled = isinstance(exc, asyncio.CancelledError)
            for *_, future in calls:
                if not future.done():
                    future.cancel() if cancelled else future.set_exception(exc)
            if cancelled:
                raise
            return
        for (*_, future), reply in zip(calls, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _pipeline(self, command: str, script: str, calls: list[Call]) -> list[Any]:
        self.round_trips += 1
        async with self.redis.pipeline(transaction=False) as pipe:
            for keys_, args, _ in calls:
                pipe.execute_command(command, script, len(keys_), *keys_, *args)
            return list(await pipe.execute(raise_on_error=False))

    async def aclose(self) -> None:
        """Wait for the pipelines already sent (shutdown: their replies still matter)."""
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
