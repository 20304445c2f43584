"""Reading a request's event log until its terminal event: the tail every response reads.

``entry_batches`` reads the log through the process's ``StreamHub`` from an explicit id, in the
batches the hub delivers them (a reader that is behind gets its backlog at once). A log that
already holds its terminal event is read in one XRANGE, so replays fold the same way every
time. While nothing arrives it yields ``[]`` every ``keepalive_s`` (the pipeline's keepalive).
Until a request's first event arrives, the wait is also bounded by ``start_timeout_s`` from its
creation; past it, ``start_timeout.claim_unstarted`` ends the request with a retryable
``Error(overloaded)`` unless a worker holds it, and that Error reaches every watcher through the
stream like any other event. A silent tail is also checked by ``stream_watch``: a log that vanished
(Redis restarted without persistence) or a stream nobody has leased for longer than the lease TTL
plus a margin ends with a retryable ``worker_lost`` error (``StreamLost``). ``tail`` is the same,
event by event.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator

from services.api.coalesce import Item, entry_items
from services.api.start_timeout import claim_unstarted, start_deadline
from services.api.state import AppState
from services.api.stream_ids import parse_id
from services.api.stream_watch import StreamWatch
from shared import keys
from shared.codec import decode_entry
from shared.errors import ProtocolError
from shared.events import is_terminal

__all__ = ["entry_batches", "finished_log", "tail"]


async def finished_log(
    state: AppState, rid: str, after: str
) -> list[tuple[str, dict[bytes, bytes]]] | None:
    """The entries after ``after`` when the log already holds its terminal event, else None.

    A finished log is read in one XRANGE instead of through the hub, so a replay (and a resume
    of a finished request) is one batch: its coalesced frames are the same on every read.

    Args:
        state: the app state.
        rid: the request id.
        after: the last entry id already seen (``0-0`` for everything).

    Returns:
        ``(entry id, fields)`` of each entry after ``after``, or None while the log is open.
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


async def entry_batches(
    state: AppState, rid: str, after: str = "0-0"
) -> AsyncGenerator[list[Item], None]:
    """Items after ``after`` in the batches they are available in; ``[]`` on each silence
    of ``keepalive_s``. Stops after the terminal event.

    Args:
        state: the app state.
        rid: the request id.
        after: the last entry id already seen (``0-0`` for everything).

    Yields:
        Batches of ``(entry id, event, whether it is the last event of its entry)``.

    Raises:
        ProtocolError: an entry does not decode (after the batch that decoded before it).
        StreamLost: nothing will ever end this stream.
    """
    keepalive_s = state.settings.keepalive_s
    finished = await finished_log(state, rid, after)
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
    async with contextlib.aclosing(entry_batches(state, rid, after)) as batches:
        async for batch in batches:
            for item in batch:
                yield item
