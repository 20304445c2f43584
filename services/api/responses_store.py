"""Stored Responses-API responses, in Redis only, so any API replica can serve them.

Owns the ``sluice:response:{rid}`` record (JSON): the owner, the request echo (the ``Response``
skeleton) and, once generation has ended, the final object. The event log is the source of
truth: until the record holds a final object, reading it folds the log and renders it with the
same code as a non-streaming answer, and the first read that sees the terminal event writes the
final object back. It also rebuilds a stored conversation for ``previous_response_id`` from the
stored request job and the stored output. Only the key that created a response can see it; to
everyone else it does not exist: ``RESPONSES`` is read through ``ownership.load_owned``.
"""

from __future__ import annotations

import msgspec

from services.api.ownership import REQUESTS, Stored, load_owned
from services.api.state import AppState
from services.api.submit import cancel
from services.api.wire.openai_responses import (
    Response,
    entry_seconds,
    items_to_messages,
    render,
)
from services.api.wire.reasoning_tokens import ReasoningSigner
from shared import keys
from shared.accumulate import fold
from shared.codec import decode_entry
from shared.errors import InvalidRequest, NotFound
from shared.events import AnyEvent, is_terminal
from shared.jobs import Message

__all__ = [
    "RESPONSES",
    "StoredResponse",
    "completed_at",
    "conversation",
    "current",
    "delete",
    "events",
    "save",
    "signer_for",
]

_FINAL = ("completed", "incomplete", "failed", "cancelled")


class StoredResponse(msgspec.Struct, kw_only=True):
    """The record under ``sluice:response:{rid}``."""

    owner: str
    skeleton: Response
    final: Response | None = None
    input_items: list[dict[str, object]] = []  # this request's own input, ids filled in
    include_encrypted: bool = False  # include asked for reasoning.encrypted_content


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(StoredResponse)


async def save(
    state: AppState,
    owner: str,
    skeleton: Response,
    input_items: list[dict[str, object]] | None = None,
    *,
    include_encrypted: bool = False,
) -> None:
    """Store a new response (its request echo) for the retention period.

    Args:
        state: the app state.
        owner: the creating key's owner id.
        skeleton: the in-progress response; ``skeleton.id`` is the request id.
        input_items: the request's input items (``GET .../input_items`` lists them).
        include_encrypted: reasoning items carry ``encrypted_content`` (the request's include).
    """
    record = StoredResponse(
        owner=owner,
        skeleton=skeleton,
        input_items=input_items or [],
        include_encrypted=include_encrypted,
    )
    await state.redis.set(
        keys.response(skeleton.id), _ENCODER.encode(record), ex=state.settings.retention_s
    )


async def _read(state: AppState, rid: str) -> tuple[str, StoredResponse] | None:
    raw = await state.redis.get(keys.response(rid))
    if raw is None:  # never stored (``store: false``), deleted or expired
        return None
    record = _DECODER.decode(raw)
    return record.owner, record


def _no_response(rid: str) -> NotFound:
    return NotFound(f"Response with id '{rid}' not found.", param="response_id")


RESPONSES: Stored[StoredResponse] = Stored(read=_read, missing=_no_response)
"""The stored Responses record (``sluice:response:{rid}``), for ``ownership.load_owned``."""


async def events(state: AppState, rid: str) -> list[AnyEvent]:
    """Read a request's event log as it is now (non-blocking).

    Args:
        state: the app state.
        rid: the request id.

    Returns:
        The events so far; the last one is terminal once generation has ended.
    """
    entries = await state.redis.xrange(keys.events(rid), "-", "+")
    return [event for _, fields in entries for event in decode_entry(fields)]


async def current(state: AppState, record: StoredResponse) -> Response:
    """The response as it stands: final if generation ended, in progress otherwise.

    Args:
        state: the app state.
        record: the stored record.

    Returns:
        The response object, rendered from the event log unless already final.
    """
    if record.final is not None:
        return record.final
    entries = await state.redis.xrange(keys.events(record.skeleton.id), "-", "+")
    log = [event for _, fields in entries for event in decode_entry(fields)]
    ended = entry_seconds(entries[-1][0]) if log and is_terminal(log[-1]) else None
    response = render(
        fold(log), record.skeleton, completed_at=ended, signer=signer_for(state, record)
    )
    if log and is_terminal(log[-1]):
        record.final = response
        # xx: a response deleted meanwhile stays deleted; keepttl: retention counts from create.
        await state.redis.set(
            keys.response(response.id), _ENCODER.encode(record), xx=True, keepttl=True
        )
    return response


async def delete(state: AppState, record: StoredResponse) -> None:
    """Delete a stored response; a finished one takes its event log and request with it.

    An unfinished one is cancelled; its log and request expire with the retention period.

    Args:
        state: the app state.
        record: the record, as its owner loaded it.
    """
    rid = record.skeleton.id
    response = await current(state, record)
    doomed = [keys.response(rid)]
    if response.status in _FINAL:
        doomed += [keys.events(rid), keys.request(rid)]
    else:
        # Nobody can read the answer any more, so stop generating it; the worker still appends
        # to the log and may need the request until it sees the flag, so those expire instead.
        await cancel(state, rid)
    await state.redis.delete(*doomed)


async def conversation(state: AppState, rid: str, owner: str) -> list[Message]:
    """Rebuild the conversation up to and including a stored response's output.

    The stored request job holds every earlier turn (its own ``previous_response_id`` history
    was folded into it when it was created); its ``instructions`` message is dropped because
    instructions never carry over. The stored output adds the assistant turn: reasoning, text
    and function calls, whose outputs the next request's ``function_call_output`` items answer.

    Args:
        state: the app state.
        rid: the previous response id.
        owner: the caller's owner id.

    Returns:
        The turns, oldest first.

    Raises:
        NotFound: no such response for this owner, or the request behind it has expired.
        InvalidRequest: the previous response is still being generated.
    """
    try:
        record = await load_owned(state, RESPONSES, rid, owner)
    except NotFound as exc:
        raise NotFound(
            f"Previous response with id '{rid}' not found.", param="previous_response_id"
        ) from exc
    response = await current(state, record)
    if response.status not in _FINAL:
        raise InvalidRequest(
            f"Previous response '{rid}' is still in progress", param="previous_response_id"
        )
    try:
        job = await load_owned(state, REQUESTS, rid, owner)
    except NotFound as exc:  # expired before the response record
        raise NotFound(
            f"Previous response with id '{rid}' not found.", param="previous_response_id"
        ) from exc
    history = job.messages[1:] if record.skeleton.instructions else job.messages
    output = [msgspec.to_builtins(item) for item in response.output]
    return items_to_messages(output, history, param="previous_response_id", signer=state.signer)


async def completed_at(state: AppState, rid: str) -> int | None:
    """When a finished request's terminal event was logged (None for an empty log).

    Args:
        state: the app state.
        rid: the request id.

    Returns:
        Unix seconds of the log's last entry.
    """
    last = await state.redis.xrevrange(keys.events(rid), "+", "-", count=1)
    return entry_seconds(last[0][0]) if last else None


def signer_for(state: AppState, record: StoredResponse) -> ReasoningSigner | None:
    """The signer a stored response's reasoning items are rendered with (None: no tokens).

    Args:
        state: the app state.
        record: the stored record.

    Returns:
        The deployment's signer when the request included ``reasoning.encrypted_content``.
    """
    return state.signer if record.include_encrypted else None
