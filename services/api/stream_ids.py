"""Redis stream entry ids as clients send them (``Last-Event-ID``, ``?after=``), checked strictly.

An id is ``<ms>-<seq>`` (or ``<ms>``), each part an unsigned 64-bit decimal. Anything else must
be refused before it reaches Redis: the hub reads every stream of the process in one XREAD, and
Redis rejects the whole call for one bad id, which would stall every other client's stream.

A request with ``n`` choices streams n logs merged into one SSE stream, so its ``id:`` is a
position in each: the last entry id of every choice the client has, comma-separated in choice
order (``0-0`` for a choice it has nothing of yet), e.g. ``1764230000000-0,0-0,1764230000003-1``.
Resuming after it continues each choice exactly where that choice stopped, whatever the
interleaving was. ``positions_id`` writes one and ``parse_positions`` reads it back, strictly.
"""

from __future__ import annotations

import re

__all__ = ["START", "StreamId", "parse_id", "parse_positions", "positions_id"]

StreamId = tuple[int, int]

_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")
_MAX = 2**64 - 1
START = "0-0"  # before the first entry: stream the whole log


def parse_id(entry_id: str) -> StreamId:
    """Parse a Redis stream id (``ms-seq`` or ``ms``) into a comparable tuple.

    Args:
        entry_id: the id text.

    Returns:
        ``(ms, seq)``.

    Raises:
        ValueError: the text is not a stream id Redis would accept.
    """
    match = _ID.fullmatch(entry_id)  # ASCII digits only: no sign, space, "_" or other scripts
    if match is None:
        raise ValueError(f"not a stream id: {entry_id!r}")
    out = (int(match[1]), int(match[2] or 0))
    if out[0] > _MAX or out[1] > _MAX:
        raise ValueError(f"stream id out of range: {entry_id!r}")
    return out


def positions_id(positions: list[str]) -> str:
    """The SSE id of a merged stream: each choice's last entry id, in choice order.

    Args:
        positions: per choice, the last entry id sent (``START`` for none).

    Returns:
        The comma-separated id.
    """
    return ",".join(positions)


def parse_positions(text: str, n: int) -> list[str]:
    """Read a merged stream's resume id back: one checked entry id per choice.

    Args:
        text: the id as the client sent it; ``START`` alone means the start of every choice.
        n: how many choices the request has.

    Returns:
        ``n`` entry ids.

    Raises:
        ValueError: not ``n`` stream ids separated by commas.
    """
    if text == START:
        return [START] * n
    parts = text.split(",")
    if len(parts) != n:
        raise ValueError(f"expected {n} comma-separated stream ids (one per choice): {text!r}")
    for part in parts:
        parse_id(part)
    return parts
