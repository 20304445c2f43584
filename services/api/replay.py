"""Resuming a wire-format stream of a stored request after the entry a client already has.

Owns the rule the chat and messages replay routes share: the resume point is ``Last-Event-ID``
(else ``?after=``, else the start), it must be a stream entry id, and a stateful projector is
first fed everything up to it, with the frames discarded, so that what follows continues the
interrupted stream exactly (no second role or ``message_start``, dense block indexes).
"""

from __future__ import annotations

from fastapi import Request

from services.api.state import AppState
from services.api.stream_ids import parse_id
from services.api.streaming import Projector
from shared import keys
from shared.codec import decode_entry
from shared.errors import InvalidRequest

__all__ = ["catch_up"]

_START = "0-0"


async def catch_up(state: AppState, request: Request, rid: str, projector: Projector) -> str:
    """Bring ``projector`` to where the client's copy of the stream ends.

    Args:
        state: the app state (its Redis holds the event log).
        request: the replay request (``Last-Event-ID`` header or ``after`` query parameter).
        rid: the request id whose stream is replayed.
        projector: a fresh projector for the stream's wire format.

    Returns:
        The entry id to stream after (``0-0`` for the whole stream).

    Raises:
        InvalidRequest: the resume point is not a stream entry id.
    """
    after = request.headers.get("last-event-id") or request.query_params.get("after") or _START
    try:
        parse_id(after)
    except ValueError as exc:
        raise InvalidRequest(f"{after!r} is not a stream entry id", param="after") from exc
    if after != _START:
        for _, fields in await state.redis.xrange(keys.events(rid), "-", after):
            for event in decode_entry(fields):
                projector.feed(event)
    return after
