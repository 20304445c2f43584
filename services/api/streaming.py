"""The one pipeline every route streams through: tail → project → SSE.

``tail`` reads a request's event log through the process's ``StreamHub`` from an explicit id until
the terminal event. ``sse_response`` feeds those events to a wire format's projector and encodes its
frames with ``sse.encode``; the Redis entry id rides on the last frame of each entry (an entry holds
one decode step's events) as the SSE ``id:``, so ``Last-Event-ID`` resumes exactly after it. A
projector with ``coalesce`` set gets a backlog's consecutive deltas folded into one
(``coalesce.fold_deltas``): a reader that is behind gets fewer, longer frames. A log that already
holds its terminal event is read in one XRANGE, so replays fold the same way every time. While
nothing arrives it sends keepalives; when the client goes away it raises the cancel flag (after a
short grace, in case it reconnects); and nothing raises past the SSE boundary once headers are out:
a failure becomes the projector's own in-band error frame. Entries that piled up for a slow client
leave in one write (``get_batch``), so an overloaded process spends fewer syscalls exactly when it
must. ``collect_events`` is the non-streaming twin (events until terminal, cancel on disconnect).
Until a request's first event arrives, the wait is also bounded by ``start_timeout_s`` from its
creation; past it, ``start_timeout.claim_unstarted`` ends the request with a retryable
``Error(overloaded)`` unless a worker holds it, and that Error reaches every watcher through the
stream like any other event. A silent tail is also checked by ``stream_watch``: a log that vanished
(Redis restarted without persistence) or a stream nobody has leased for longer than the lease TTL
plus a margin ends with a retryable ``worker_lost`` error (``StreamLost``). A projector with
``ndjson`` set streams newline-delimited JSON instead of SSE (``wire.ndjson``): the same
pipeline, its frames one line each, no ids and no keepalives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

from fastapi import Request
from starlette.requests import ClientDisconnect

from services.api import access
from services.api.coalesce import Item, entry_items, fold_deltas
from services.api.metrics import format_of
from services.api.sse_asgi import Ending, SSEResponse
from services.api.start_timeout import claim_unstarted, start_deadline
from services.api.state import AppState
from services.api.stream_ids import parse_id
from services.api.stream_watch import StreamLost, StreamWatch
from services.api.submit import cancel
from services.api.wire import ndjson, sse
from services.redis_oom import OOM_MESSAGE, is_oom
from shared import keys
from shared.codec import decode_entry
from shared.errors import ProtocolError
from shared.events import TERMINAL, AnyEvent, Error, Usage, is_terminal

__all__ = ["Projector", "collect_events", "sse_response", "tail"]

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


async def _finished_log(
    state: AppState, rid: str, after: str
) -> list[tuple[str, dict[bytes, bytes]]] | None:
    """The entries after ``after`` when the log already holds its terminal event, else None.

    A finished log is read in one XRANGE instead of through the hub, so a replay (and a resume
    of a finished request) is one batch: its coalesced frames are the same on every read.
    """
    key = keys.events(rid)
    last = await state.redis.xrevrange(key, count=1)
    try:
        if not last or not is_terminal(decode_entry(last[0][1])[-1]):
            return None
    except ProtocolError:
        return None  # the tail delivers what decodes before it, then fails in-band

    last_id = last[0][0].decode()
    if after != "0-0" and parse_id(last_id) <= parse_id(after):
        return []  # resumed after the terminal entry: nothing will ever follow it
    low = "-" if after == "0-0" else f"({after}"
    raw = await state.redis.xrange(key, low, "+")
    return [(entry_id.decode(), fields) for entry_id, fields in raw]


async def _batches(state: AppState, rid: str, after: str) -> AsyncGenerator[list[Item], None]:
    """Items after ``after`` in the batches they are available in; ``[]`` on each silence
    of ``keepalive_s``. Stops after the terminal event."""
    keepalive_s = state.settings.keepalive_s
    finished = await _finished_log(state, rid, after)
    if finished is not None:
        items, error = entry_items(finished)
        if items:
            yield items
        if error is not None:
            raise error
        return
    # Until the first entry arrives the wait is also bounded by the start deadline; a client
    # resuming after an entry id saw the request start already.
    deadline = None if after != "0-0" else await start_deadline(state.redis, rid, state.settings)
    watch = StreamWatch(state, rid, started=after != "0-0")
    async with state.hub.subscription(keys.events(rid), after) as sub:
        quiet_since = checked = time.monotonic()
        while True:
            now = time.monotonic()
            wait_s = min(keepalive_s - (now - quiet_since), watch.check_s - (now - checked))
            if deadline is not None:
                if deadline <= time.monotonic():
                    # Past the deadline: end it unless a worker got there first (then look
                    # again a keepalive later, in case that worker dies before its Start).
                    await claim_unstarted(state.redis, rid, state.settings, queue=state.queue)
                    deadline = time.monotonic() + keepalive_s
                wait_s = min(wait_s, deadline - time.monotonic())
            entries = await sub.get_batch(max(wait_s, 0.0))
            if entries:
                deadline = None
                watch.alive()
                # Entries are proof of life (the log exists and a worker writes it): only a
                # tail silent for ``check_s`` is checked, not every stream every ``check_s``.
                checked = time.monotonic()
            else:
                if time.monotonic() - checked >= watch.check_s:
                    checked = time.monotonic()
                    await watch.check()  # raises StreamLost when nothing will ever end it
                if time.monotonic() - quiet_since < keepalive_s:
                    continue  # woken by a deadline or a check, not by a silence: no keepalive
            quiet_since = time.monotonic()
            items, error = entry_items(entries)
            if items or not entries:
                yield items  # deliver what decoded before failing
            if error is not None:
                raise error
            if items and is_terminal(items[-1][1]):
                return


async def tail(state: AppState, rid: str, after: str = "0-0") -> AsyncIterator[Item]:
    """Yield the events of a request's stream after ``after`` until the terminal event.

    Args:
        state: the app state.
        rid: the request id.
        after: the last entry id already seen (``0-0`` for everything).

    Yields:
        ``(entry id, event, whether it is the last event of its entry)``; the last one yielded
        is terminal.

    Raises:
        ProtocolError: an entry does not decode.
    """
    async with contextlib.aclosing(_batches(state, rid, after)) as batches:
        async for batch in batches:
            for item in batch:
                yield item


def _spawn(state: AppState, coro: Coroutine[Any, Any, None]) -> None:
    # Called from a cancelled scope (client disconnect), where awaiting is no longer possible:
    # run it as its own task and keep a reference so it is not garbage-collected mid-flight.
    task = asyncio.get_running_loop().create_task(coro)
    state.background.add(task)
    task.add_done_callback(state.background.discard)


async def _cancel_quietly(state: AppState, rid: str) -> None:
    try:
        await cancel(state, rid)
    except Exception:  # boundary: a dead Redis must not turn a disconnect into a crash
        logger.exception("could not set the cancel flag of %s", rid)


async def _cancel_unless_resumed(state: AppState, rid: str) -> None:
    await asyncio.sleep(CANCEL_GRACE_S)
    if not state.hub.watching(keys.events(rid)):
        await _cancel_quietly(state, rid)


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
    state: AppState,
    rid: str,
    projector: Projector,
    after: str,
    keepalive: sse.Frame | None,
    ending: Ending,
) -> AsyncGenerator[bytes, None]:
    lines = bool(getattr(projector, "ndjson", False))
    encode = ndjson.encode if lines else sse.encode
    ping = b"" if lines else sse.encode(keepalive) if keepalive is not None else sse.comment()
    finished = False
    rec = access.record()
    began = time.perf_counter()
    # A projector that reports when things happened (Responses' completed_at) reads it off the
    # log's entry ids, the same for every reader; looked up once, not per event.
    stamp: Callable[[str], None] | None = getattr(projector, "stamp", None)
    # A projector opts in to folding a backlog's deltas into fewer frames (``coalesce``).
    folds = bool(getattr(projector, "coalesce", False))
    try:
        async with contextlib.aclosing(_batches(state, rid, after)) as batches:
            async for batch in batches:
                if not batch:
                    if ping:
                        yield ping
                    continue
                if rec is not None and rec.ttft_ms is None:
                    rec.ttft_ms = round((time.perf_counter() - began) * 1000, 1)
                out = _encode(fold_deltas(batch) if folds else batch, projector, stamp, rec, encode)
                # A batch holds at most one terminal event, as its last item (``_batches``).
                finished = type(batch[-1][1]) in TERMINAL
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
        if not finished:  # resumed after the terminal entry: only the format's end is left
            finished = True
            if end := b"".join(encode(f, None) for f in projector.close()):
                yield end
    except StreamLost as exc:  # nothing will end this stream: a retryable error ends it here
        finished = True
        lost = Error(kind="worker_lost", message=exc.message, retryable=True)
        yield b"".join(encode(f, None) for f in [*projector.feed(lost), *projector.close()])
    except Exception as exc:  # boundary: after the headers, errors travel in-band only
        logger.exception("stream of %s failed", rid)
        finished = True
        _spawn(state, _cancel_quietly(state, rid))
        error = Error(kind="internal", message=f"stream interrupted: {exc}", retryable=True)
        if is_oom(exc):  # e.g. the start timeout's write refused by a full Redis
            error = Error(kind="overloaded", message=OOM_MESSAGE, retryable=True)
        with contextlib.suppress(Exception):
            yield b"".join(encode(f, None) for f in [*projector.feed(error), *projector.close()])
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
    _count_reads(state, request, resumed=after != "0-0")
    ending = Ending()

    def abandon() -> None:  # client gone before the end
        _spawn(state, _cancel_unless_resumed(state, rid))

    framing = ndjson.HEADERS if getattr(projector, "ndjson", False) else sse.HEADERS
    return SSEResponse(
        _frames(state, rid, projector, after, keepalive, ending),
        ending,
        abandon if cancel_on_disconnect else None,
        {**framing, **(headers or {})},
    )


def _count_reads(state: AppState, request: Request, *, resumed: bool) -> None:
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


async def _wait_disconnect(request: Request) -> None:
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
    _count_reads(state, request, resumed=False)

    async def gather() -> None:
        async for _, event, _ in tail(state, rid):
            events.append(event)

    started = time.monotonic()
    gatherer = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
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
    await _cancel_quietly(state, rid)
    raise ClientDisconnect(f"client left after {time.monotonic() - started:.1f}s")
