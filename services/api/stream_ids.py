"""Redis stream entry ids as clients send them (``Last-Event-ID``, ``?after=``), checked strictly.

An id is ``<ms>-<seq>`` (or ``<ms>``), each part an unsigned 64-bit decimal. Anything else must
be refused before it reaches Redis: the hub reads every stream of the process in one XREAD, and
Redis rejects the whole call for one bad id, which would stall every other client's stream.
"""

from __future__ import annotations

import re

__all__ = ["StreamId", "parse_id"]

StreamId = tuple[int, int]

_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")
_MAX = 2**64 - 1


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
