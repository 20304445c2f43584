"""Folding a slow reader's backlog of deltas into fewer events, so fewer SSE frames go out.

A client that reads slower than the worker writes (or a replay of a finished log) finds several
entries waiting at once. Projecting each text token as its own frame then costs the API a JSON
encoding, an SSE frame and a socket write per token, and the client a parse per token, for text
it receives in one read anyway. ``fold_deltas`` joins runs of consecutive deltas of one kind
before projection: ``TextDelta`` with ``TextDelta``, ``ReasoningDelta`` with ``ReasoningDelta``,
``ToolCallArgsDelta`` with ``ToolCallArgsDelta`` of the same call. A joined delta is the
concatenation of its parts (text, token ids, logprobs), so ``fold`` of the events, and the
text every projector shows, are unchanged (the separator gate works on characters, not on
delta boundaries).

Resume ids stay exact: each item carries the entry id and whether it is the last event of its
entry; only such items put an ``id:`` on the wire. A joined delta ends where its last part
ends, so it carries that part's id, and the client that resumes after it has every part. A run
never grows from an entry's end into the middle of the next entry (that would take away an id
the client could resume after, and give it none in return).

What is folded depends only on the items handed in: the same batch always gives the same
events. Live, a batch is whatever the hub had buffered, so frame boundaries depend on timing;
a replay of a finished log is read as one batch (``streaming``), so its bytes are always the
same.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.codec import decode_entry
from shared.errors import ProtocolError
from shared.events import AnyEvent, Delta, delta_text, is_terminal, joinable, joined

__all__ = ["MAX_FOLD_CHARS", "Item", "entry_items", "fold_deltas"]

Item = tuple[str, AnyEvent, bool]
"""``(entry id, event, whether it is the last event of that entry)``."""

# A run stops growing at this much text, so a replayed answer of any length still goes out in
# frames of bounded size (a client's line buffer, a proxy's) while costing a frame per 16 KiB.
MAX_FOLD_CHARS = 16_384


def fold_deltas(items: Iterable[Item]) -> list[Item]:
    """Join runs of consecutive same-kind deltas; every other event passes unchanged.

    Args:
        items: a batch of ``(entry id, event, ends entry)`` in log order.

    Returns:
        The same events with each run joined into one delta that carries the run's last
        entry id and end-of-entry flag.
    """
    out: list[Item] = []
    run: list[AnyEvent] = []
    run_chars = 0
    tail: tuple[str, bool] = ("", False)  # id and end flag of the run's last part

    def flush() -> None:
        if run:
            out.append((tail[0], joined(run), tail[1]))
            run.clear()

    for entry_id, event, ends in items:
        if not isinstance(event, Delta):
            flush()
            out.append((entry_id, event, ends))
            continue
        joins = bool(
            run
            and joinable(run[-1], event)
            and run_chars < MAX_FOLD_CHARS
            and (ends or not tail[1])  # never from an entry's end into the middle of the next
        )
        if not joins:
            flush()
            run_chars = 0
        run.append(event)
        run_chars += len(delta_text(event))
        tail = (entry_id, ends)
    flush()
    return out


def entry_items(
    entries: list[tuple[str, dict[bytes, bytes]]],
) -> tuple[list[Item], Exception | None]:
    """Decode ``(entry id, fields)`` pairs into items (each event with its entry id, the last of
    each entry flagged), stopping after a terminal event; an undecodable entry ends the list
    and its error is returned beside it (the caller delivers what decoded, then fails)."""
    items: list[Item] = []
    for entry_id, fields in entries:
        try:
            events = decode_entry(fields)
        except ProtocolError as exc:
            return items, exc
        last = len(events) - 1
        for i, event in enumerate(events):
            items.append((entry_id, event, i == last))
            if is_terminal(event):
                return items, None
    return items, None
