"""The one pipeline every route streams through: tail → project → SSE.

``sse_response`` reads a request's event log (``tailing.entry_batches``), feeds the events to a
wire format's projector and encodes its frames with ``sse.encode``; the Redis entry id rides on
the last frame of each entry (an entry holds one decode step's events) as the SSE ``id:``, so
``Last-Event-ID`` resumes exactly after it. A projector with ``coalesce`` set gets a backlog's
consecutive deltas folded into one (``coalesce.fold_deltas``): a reader that is behind gets
fewer, longer frames. While nothing arrives it sends keepalives; when the client goes away it
raises the cancel flag (after a short grace, in case it reconnects); and nothing raises past the
SSE boundary once headers are out: a failure becomes the projector's own in-band error frame.
Entries that piled up for a slow client leave in one write (``get_batch``), so an overloaded
process spends fewer syscalls exactly when it must. ``collect_events`` is the non-streaming twin
(events until terminal, cancel on disconnect). A projector with ``ndjson`` set streams
newline-delimited JSON instead of SSE (``wire.ndjson``): the same pipeline, its frames one line
each, no ids and no keepalives.

What the pipeline streams is a ``Plan``: where batches come from and how a batch becomes bytes.
``sse_response`` streams one log (``_OneLog``); a request with ``n`` choices streams the merge
of n logs through the same boundary (``services.api.choices``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, Protocol

from fastapi import Request
from starlette.requests import ClientDisconnect

from services.api import access
from services.api.coalesce import Item, fold_deltas
from services.api.formats import format_of
from services.api.sse_asgi import Ending, SSEResponse
from services.api.state import AppState
from services.api.stream_watch import StreamLost
from services.api.submit import cancel
from services.api.tailing import entry_batches, tail
from services.api.wire import ndjson, sse
from services.redis_oom import OOM_MESSAGE, is_oom
from shared import keys
from shared.events import TERMINAL, AnyEvent, Error, Usage

__all__ = [
    "Plan",
    "Projector",
    "cancel_quietly",
    "collect_events",
    "count_reads",
    "plan_response",
    "spawn",
    "sse_response",
    "tail",
    "wait_disconnect",
]

logger = logging.getLogger(__name__)

# A client whose connection drops often comes straight back with Last-Event-ID (the SDKs and
# sluice_client do). Cancelling at once would kill the answer it is about to resume, so the
# cancel waits this long and is skipped if this process is streaming the request again by then.
CANCEL_GRACE_S = 1.0


class Projector(Protocol):
    """Turns events into one wire format's SSE frames; pure (no I/O, no clock, no ids).

    Optional attributes, looked up once per stream: ``coalesce`` (True: fold a backlog's deltas
    before feeding them), ``stamp(entry_id)`` (told each event's entry id before its feed) and
    ``ndjson`` (True: frames are NDJSON lines, not SSE events).
    """

    def feed(self, event: AnyEvent) -> list[sse.Frame]:
        """Frames for one event (possibly none)."""
        ...

    def close(self) -> list[sse.Frame]:
        """Frames after the terminal event (e.g. ``data: [DONE]``)."""
        ...


class Plan(Protocol):
    """What the pipeline streams: batches from one or more logs, and their bytes.

    ``rids``: the requests it reads (cancelled when the stream fails or the client leaves).
    ``lines``: NDJSON lines, not SSE events.
    """

    rids: list[str]
    lines: bool

    def batches(self) -> AsyncGenerator[list[Any], None]:
        """Batches as they become available; ``[]`` on each silence of ``keepalive_s``."""
        ...

    def encode(
        self,
        batch: list[Any],
        rec: access.AccessRecord | None,
        encode: Callable[..., bytes],
    ) -> tuple[list[bytes], bool]:
        """One batch's bytes, and whether the answer is complete after it."""
        ...

    def close(self) -> list[sse.Frame]:
        """The format's end of stream, once."""
        ...

    def fail(self, error: Error) -> list[sse.Frame]:
        """The frames that end a broken stream with ``error``."""
        ...


class _OneLog:
    """One request's log through its projector: what every route but ``n`` > 1 streams."""

    lines: bool

    def __init__(self, state: AppState, rid: str, projector: Projector, after: str) -> None:
        self.rids = [rid]
        self.projector, self._state, self._after = projector, state, after
        self.lines = bool(getattr(projector, "ndjson", False))
        # A projector that reports when things happened (Responses' completed_at) reads it off
        # the log's entry ids, the same for every reader; looked up once, not per event.
        self._stamp: Callable[[str], None] | None = getattr(projector, "stamp", None)
        # A projector opts in to folding a backlog's deltas into fewer frames (``coalesce``).
        self._folds = bool(getattr(projector, "coalesce", False))

    def batches(self) -> AsyncGenerator[list[Item], None]:
        return entry_batches(self._state, self.rids[0], self._after)

    def encode(
        self, batch: list[Item], rec: access.AccessRecord | None, encode: Callable[..., bytes]
    ) -> tuple[list[bytes], bool]:
        items = fold_deltas(batch) if self._folds else batch
        out = _encode(items, self.projector, self._stamp, rec, encode)
        # A batch holds at most one terminal event, as its last item (``entry_batches``).
        return out, type(batch[-1][1]) in TERMINAL

    def close(self) -> list[sse.Frame]:
        return self.projector.close()

    def fail(self, error: Error) -> list[sse.Frame]:
        return [*self.projector.feed(error), *self.projector.close()]


def spawn(state: AppState, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` as a task the app keeps a reference to (awaiting is no longer possible)."""
    # Called from a cancelled scope (client disconnect), where awaiting is no longer possible:
    # run it as its own task and keep a reference so it is not garbage-collected mid-flight.
    task = asyncio.get_running_loop().create_task(coro)
    state.background.add(task)
    task.add_done_callback(state.background.discard)


async def cancel_quietly(state: AppState, *rids: str) -> None:
    """Raise the cancel flags of ``rids``; a failure is logged, never raised."""
    try:
        await cancel(state, *rids)
    except Exception:  # boundary: a dead Redis must not turn a disconnect into a crash
        logger.exception("could not set the cancel flag of %s", ",".join(rids))


async def _cancel_unless_resumed(state: AppState, rids: list[str]) -> None:
    await asyncio.sleep(CANCEL_GRACE_S)
    if not any(state.hub.watching(keys.events(rid)) for rid in rids):
        await cancel_quietly(state, *rids)


def _encode(
    items: list[Item],
    projector: Projector,
    stamp: Callable[[str], None] | None,
    rec: access.AccessRecord | None,
    encode: Callable[..., bytes] = sse.encode,
) -> list[bytes]:
    """One batch's SSE bytes, frame by frame (the format's end after a terminal event)."""
    # Per event, this loop's cost is the process's: the bound methods are looked up once, and
    # one frame (the usual case) is encoded without a slice or a generator.
    out: list[bytes] = []
    feed = projector.feed
    for entry_id, event, ends in items:
        if stamp is not None:
            stamp(entry_id)
        frames = feed(event)
        if frames:  # the entry id rides on the last frame of the entry's last event
            if len(frames) > 1:
                out.extend(map(encode, frames[:-1]))
            out.append(encode(frames[-1], entry_id if ends else None))
        if type(event) in TERMINAL:
            out.extend(map(encode, projector.close()))
        elif type(event) is Usage and rec is not None:
            rec.input_tokens, rec.output_tokens = event.input_tokens, event.output_tokens
    return out


async def _frames(
    state: AppState, plan: Plan, keepalive: sse.Frame | None, ending: Ending
) -> AsyncGenerator[bytes, None]:
    encode = ndjson.encode if plan.lines else sse.encode
    ping = b"" if plan.lines else sse.encode(keepalive) if keepalive is not None else sse.comment()
    finished = False
    rec = access.record()
    began = time.perf_counter()
    try:
        async with contextlib.aclosing(plan.batches()) as batches:
            async for batch in batches:
                if not batch:
                    if ping:
                        yield ping
                    continue
                if rec is not None and rec.ttft_ms is None:
                    rec.ttft_ms = round((time.perf_counter() - began) * 1000, 1)
                out, finished = plan.encode(batch, rec, encode)
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
                if finished:
                    break
        if not finished:  # resumed after the terminal entry: only the format's end is left
            finished = True
            if end := b"".join(encode(f, None) for f in plan.close()):
                yield end
    except StreamLost as exc:  # nothing will end this stream: a retryable error ends it here
        finished = True
        lost = Error(kind="worker_lost", message=exc.message, retryable=True)
        yield b"".join(encode(f, None) for f in plan.fail(lost))
    except Exception as exc:  # boundary: after the headers, errors travel in-band only
        logger.exception("stream of %s failed", plan.rids[0])
        finished = True
        spawn(state, cancel_quietly(state, *plan.rids))
        error = Error(kind="internal", message=f"stream interrupted: {exc}", retryable=True)
        if is_oom(exc):  # e.g. the start timeout's write refused by a full Redis
            error = Error(kind="overloaded", message=OOM_MESSAGE, retryable=True)
        with contextlib.suppress(Exception):
            yield b"".join(encode(f, None) for f in plan.fail(error))
    finally:
        ending.finished = finished


def sse_response(
    state: AppState,
    request: Request,
    rid: str,
    projector: Projector,
    *,
    after: str = "0-0",
    keepalive: sse.Frame | None = None,
    headers: dict[str, str] | None = None,
    cancel_on_disconnect: bool = True,
) -> SSEResponse:
    """Stream a request's events to the client through ``projector`` as SSE.

    Args:
        state: the app state.
        request: the HTTP request (its path names the wire format in the metrics; disconnects
            are seen by ``SSEResponse``, which cancels the body).
        rid: the request id.
        projector: the wire format's projector.
        after: resume after this entry id (``Last-Event-ID``); ``0-0`` streams everything.
        keepalive: a frame to send on silence (e.g. Anthropic's ``ping``); default an SSE comment.
        headers: extra response headers (e.g. a request id header).
        cancel_on_disconnect: False for an observer (e.g. re-streaming a stored background
            response), whose leaving must not stop the generation.

    Returns:
        The streaming response.
    """
    count_reads(state, request, resumed=after != "0-0")
    plan = _OneLog(state, rid, projector, after)
    return plan_response(
        state,
        plan,
        keepalive=keepalive,
        headers=headers,
        cancel_on_disconnect=cancel_on_disconnect,
    )


def plan_response(
    state: AppState,
    plan: Plan,
    *,
    keepalive: sse.Frame | None = None,
    headers: dict[str, str] | None = None,
    cancel_on_disconnect: bool = True,
) -> SSEResponse:
    """Stream ``plan`` to the client (``sse_response`` for one log; ``n`` > 1 merges several).

    Args:
        state: the app state.
        plan: what to stream.
        keepalive: a frame to send on silence; default an SSE comment.
        headers: extra response headers.
        cancel_on_disconnect: False for an observer, whose leaving must not stop generation.

    Returns:
        The streaming response.
    """
    ending = Ending()

    def abandon() -> None:  # client gone before the end
        spawn(state, _cancel_unless_resumed(state, plan.rids))

    framing = ndjson.HEADERS if plan.lines else sse.HEADERS
    return SSEResponse(
        _frames(state, plan, keepalive, ending),
        ending,
        abandon if cancel_on_disconnect else None,
        {**framing, **(headers or {})},
    )


def count_reads(state: AppState, request: Request, *, resumed: bool) -> None:
    """Count a GET of a stored request as a replay, and a stream resumed after an entry."""
    fmt = format_of(request.url.path)
    if request.method == "GET":
        state.metrics.replays.labels(fmt).inc()
    if resumed or int(request.query_params.get("starting_after", -1) or -1) >= 0:
        state.metrics.resumes.labels(fmt).inc()


def _note_usage(events: list[AnyEvent]) -> None:
    rec = access.record()
    usage = next((e for e in reversed(events) if isinstance(e, Usage)), None)
    if rec is not None and usage is not None:
        rec.usage(usage.input_tokens, usage.output_tokens)


async def wait_disconnect(request: Request) -> None:
    """Return when the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_events(state: AppState, request: Request, rid: str) -> list[AnyEvent]:
    """Gather a request's events until the terminal one, for a non-streaming response.

    Args:
        state: the app state.
        request: the HTTP request, watched for a client disconnect (body already read).
        rid: the request id.

    Returns:
        Every event of the stream, the terminal one last.

    Raises:
        ClientDisconnect: the client left first; the cancel flag has been set.
        ProtocolError: an entry does not decode.
    """
    events: list[AnyEvent] = []
    count_reads(state, request, resumed=False)

    async def gather() -> None:
        async for _, event, _ in tail(state, rid):
            events.append(event)

    started = time.monotonic()
    gatherer = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({gatherer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gatherer, watcher):
            task.cancel()
        await asyncio.gather(gatherer, watcher, return_exceptions=True)
    if gatherer in done:
        gatherer.result()  # re-raise a decode failure
        _note_usage(events)
        return events
    await cancel_quietly(state, rid)
    raise ClientDisconnect(f"client left after {time.monotonic() - started:.1f}s")
