"""A request's ``n`` choices, read as one answer: n logs tailed together and merged.

Each choice is a request of its own (``shared.jobs.choice_id``: ``rid``, ``rid.1``, ...), with
its own log, lease, failover and start timeout, all of which the single-log pipeline already
handles; this module only reads several of them at once. ``ChoicesPlan`` is the streaming
pipeline's ``Plan`` for them: each choice's log is tailed by its own ``entry_batches`` task,
batches are delivered as they arrive, a backlog is folded per choice and interleaved by entry id
(the order the worker wrote them; a finished request is read at once, so its replay is the same
every time), and every event goes through ``wire.choices.ChoiceMerge``. The SSE ``id:`` is the
position in every log (``stream_ids.positions_id``), so ``Last-Event-ID`` resumes each choice
exactly (``catch_up_choices``). ``collect_choices`` is the non-streaming twin. A choice that
fails ends the answer; the create route then cancels the others, as a disconnect cancels all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Iterator

from fastapi import Request
from starlette.requests import ClientDisconnect

from services.api import access
from services.api.coalesce import Item, entry_items, fold_deltas
from services.api.ownership import REQUESTS, load_owned
from services.api.state import AppState
from services.api.stream_ids import START, parse_id, parse_positions, positions_id
from services.api.streaming import cancel_quietly, count_reads, spawn, wait_disconnect
from services.api.tailing import entry_batches, finished_log, tail
from services.api.wire import sse
from services.api.wire.choices import ChoiceMerge, merge_usage
from shared import keys
from shared.codec import decode_entry
from shared.errors import InvalidRequest
from shared.events import AnyEvent, Error, Usage
from shared.jobs import GenerateRequest, choice_id

__all__ = ["ChoicesPlan", "catch_up_choices", "collect_choices", "owned_choices"]

_Batch = list[tuple[int, list[Item]]]  # (choice, that choice's items), in arrival order


class ChoicesPlan:
    """The streaming pipeline's plan for a request's choices (``streaming.plan_response``)."""

    lines = False

    def __init__(
        self,
        state: AppState,
        rids: list[str],
        merge: ChoiceMerge,
        positions: list[str] | None = None,
        *,
        cancel_on_failure: bool = False,
    ) -> None:
        """Plan to stream ``rids`` (choice i's log is ``rids[i]``) through ``merge``.

        Args:
            state: the app state.
            rids: the choices' request ids, choice 0 first.
            merge: the merge of the choices' projectors.
            positions: where each choice resumes (``catch_up_choices``); None: from the start.
            cancel_on_failure: when a choice fails, cancel the others (the request's creator
                streams; an observer's replay changes nothing).
        """
        self.rids, self.merge, self._state = rids, merge, state
        self.positions = list(positions or [START] * len(rids))
        self._cancel_on_failure = cancel_on_failure

    async def batches(self) -> AsyncGenerator[_Batch, None]:
        """Every choice's batches, as they arrive; ``[]`` on each silence of ``keepalive_s``.

        A request whose logs all hold their terminal event is read as one batch, so a replay
        interleaves the choices the same way every time (by entry id, ``encode``).
        """
        logs = await asyncio.gather(
            *(
                finished_log(self._state, rid, after)
                for rid, after in zip(self.rids, self.positions, strict=True)
            )
        )
        if all(log is not None for log in logs):
            decoded = [entry_items(log or []) for log in logs]
            if batch := [(i, items) for i, (items, _) in enumerate(decoded) if items]:
                yield batch  # none: resumed after every terminal entry, only the end is left
            if errors := [error for _, error in decoded if error is not None]:
                raise errors[0]
            return
        async with contextlib.aclosing(self._live()) as live:
            async for batch in live:
                yield batch

    async def _live(self) -> AsyncGenerator[_Batch, None]:
        queue: asyncio.Queue[tuple[int, list[Item] | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                batches = entry_batches(self._state, self.rids[i], self.positions[i])
                async with contextlib.aclosing(batches) as each:
                    async for batch in each:
                        if batch:  # a silence of one log is not the stream's
                            queue.put_nowait((i, batch))
                queue.put_nowait((i, None))
            except Exception as exc:  # handed to the reader, which raises it at the boundary
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.rids))]
        running = len(tasks)
        try:
            while running:
                try:
                    async with asyncio.timeout(self._state.settings.keepalive_s):
                        got = [await queue.get()]
                except TimeoutError:
                    yield []
                    continue
                while not queue.empty():
                    got.append(queue.get_nowait())
                out: _Batch = []
                failure: BaseException | None = None
                for i, batch in got:
                    if batch is None:
                        running -= 1
                    elif isinstance(batch, BaseException):
                        failure = failure or batch
                    else:
                        out.append((i, batch))
                if out:
                    yield out  # what decoded before a failure still goes out
                if failure is not None:
                    raise failure
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def encode(
        self, batch: _Batch, rec: access.AccessRecord | None, encode: Callable[..., bytes]
    ) -> tuple[list[bytes], bool]:
        """One batch's bytes: each choice's backlog folded, each entry's last frame carrying
        the position in every log; complete when the merge has ended."""
        out: list[bytes] = []
        merge = self.merge
        for i, (entry_id, event, ends) in _in_log_order(batch, fold=merge.coalesce):
            frames = merge.feed(i, event)
            if ends:
                self.positions[i] = entry_id
            if frames:
                out.extend(map(encode, frames[:-1]))
                out.append(encode(frames[-1], positions_id(self.positions) if ends else None))
            if merge.ended:
                break
        if merge.ended:
            out.extend(map(encode, merge.close()))
            if merge.failed and self._cancel_on_failure:
                spawn(self._state, cancel_quietly(self._state, *self.rids))
            if rec is not None and (usage := merge.usage) is not None:
                rec.input_tokens, rec.output_tokens = usage.input_tokens, usage.output_tokens
        return out, merge.ended

    def close(self) -> list[sse.Frame]:
        """The format's end of stream, once."""
        return self.merge.close()

    def fail(self, error: Error) -> list[sse.Frame]:
        """End a broken stream with ``error`` (a lost log, say): the creator's other choices
        would run on for nobody, so they are cancelled."""
        if self._cancel_on_failure:
            spawn(self._state, cancel_quietly(self._state, *self.rids))
        return self.merge.fail(error)


def _in_log_order(batch: _Batch, *, fold: bool) -> list[tuple[int, Item]]:
    """A batch's items across choices in the order they were written: by entry id (the time a
    worker appended them), ties by choice; each choice's backlog folded first when ``fold``."""
    tagged = [
        (parse_id(item[0]), i, k, item)
        for i, items in batch
        for k, item in enumerate(fold_deltas(items) if fold else items)
    ]
    tagged.sort(key=lambda t: t[:3])
    return [(i, item) for _, i, _, item in tagged]


async def catch_up_choices(
    state: AppState, request: Request, rids: list[str], merge: ChoiceMerge
) -> list[str]:
    """Bring ``merge`` to where the client's copy of the merged stream ends.

    Args:
        state: the app state.
        request: the replay request (``Last-Event-ID``, else ``?after=``, else the start).
        rids: the choices' request ids.
        merge: a fresh merge of fresh projectors.

    Returns:
        Each choice's position to stream after.

    Raises:
        InvalidRequest: the resume point is not one stream id per choice.
    """
    after = request.headers.get("last-event-id") or request.query_params.get("after") or START
    try:
        positions = parse_positions(after, len(rids))
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="after") from exc
    for i, (rid, position) in enumerate(zip(rids, positions, strict=True)):
        if position == START:
            continue
        for _, fields in await state.redis.xrange(keys.events(rid), "-", position):
            for event in decode_entry(fields):
                merge.feed(i, event)
    return positions


async def collect_choices(
    state: AppState, request: Request, rids: list[str]
) -> list[list[AnyEvent]]:
    """Gather every choice's events until each is terminal, for a non-streaming response.

    A choice that ends with an ``Error`` ends the wait: the answer is that error, and the other
    choices are cancelled.

    Args:
        state: the app state.
        request: the HTTP request, watched for a client disconnect (body already read).
        rids: the choices' request ids, choice 0 first.

    Returns:
        Each choice's events (complete unless one of them failed).

    Raises:
        ClientDisconnect: the client left first; every choice's cancel flag has been set.
        ProtocolError: an entry does not decode.
    """
    events: list[list[AnyEvent]] = [[] for _ in rids]
    count_reads(state, request, resumed=False)

    async def gather(i: int) -> bool:
        async for _, event, _ in tail(state, rids[i]):
            events[i].append(event)
        return isinstance(events[i][-1], Error)

    started = time.monotonic()
    gatherers = {asyncio.ensure_future(gather(i)) for i in range(len(rids))}
    watcher = asyncio.ensure_future(wait_disconnect(request))
    pending = set(gatherers)
    failed = False
    try:
        while pending and not failed:
            done, _ = await asyncio.wait({*pending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                break
            pending -= done
            failed = any(task.result() for task in done)  # re-raises a decode failure
    finally:
        for task in (*gatherers, watcher):
            task.cancel()
        await asyncio.gather(*gatherers, watcher, return_exceptions=True)
    if pending and not failed:
        await cancel_quietly(state, *rids)
        raise ClientDisconnect(f"client left after {time.monotonic() - started:.1f}s")
    if failed:
        await cancel_quietly(state, *rids)
    elif (rec := access.record()) is not None:
        usage = merge_usage([next(_usages(ev), None) for ev in events])
        if usage is not None:
            rec.usage(usage.input_tokens, usage.output_tokens)
    return events


def _usages(events: list[AnyEvent]) -> Iterator[Usage]:
    return (e for e in reversed(events) if isinstance(e, Usage))


async def owned_choices(state: AppState, job: GenerateRequest, owner: str) -> list[str]:
    """The request ids of a stored request's choices, each checked to be the caller's.

    Args:
        state: the app state.
        job: the request as loaded (choice 0, through ``ownership.load_owned``).
        owner: the caller's owner id.

    Returns:
        ``job.n`` request ids, choice 0 first.

    Raises:
        NotFound: a choice's record is gone or is not the caller's.
    """
    rids = [choice_id(job.request_id, i) for i in range(job.n)]
    for rid in rids[1:]:
        await load_owned(state, REQUESTS, rid, owner)
    return rids
