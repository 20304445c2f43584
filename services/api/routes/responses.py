"""``/v1/responses``: create (stream, not, or background), retrieve (or re-stream), delete, cancel.

Thin: authentication already ran as the router's dependency; parsing and projection live in
``wire.openai_responses``, storage in ``responses_store``. The response id (``resp_...``) is the
request id, so the event log, the request hash and the stored response share it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

import msgspec
from fastapi import Request, Response

from services.api import responses_store
from services.api.auth import authenticate
from services.api.formats import FormatRouter
from services.api.ownership import load_owned
from services.api.state import get_state
from services.api.streaming import collect_events, sse_response, tail
from services.api.submit import cancel, new_request_id, submit
from services.api.wire import openai_errors, openai_responses
from services.api.wire.common import service_error
from services.api.wire.extra_fields import IGNORED_FIELDS_HEADER
from shared.accumulate import fold
from shared.errors import InvalidRequest

__all__ = ["router"]

router = FormatRouter("/v1/responses", "openai_responses", openai_errors.error_body)

_ENCRYPTED = "reasoning.encrypted_content"  # include value: reasoning items carry a token
_CANCEL_WAIT_S = 5.0  # how long POST .../cancel waits for the worker to acknowledge


def _json(obj: object, rid: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(obj),
        media_type="application/json",
        headers={"x-request-id": rid, **(headers or {})},
    )


@router.post("")
async def create_response(request: Request) -> Response:
    """Create a response (OpenAI Responses wire format)."""
    state = get_state(request)
    owner = await authenticate(request)
    raw = await request.body()
    req = openai_responses.parse_request(raw)
    rid = new_request_id("resp")
    history = []
    if req.previous_response_id is not None:
        history = await responses_store.conversation(state, req.previous_response_id, owner)
    conversation = openai_responses.input_messages(req, history, state.signer)
    job = openai_responses.build_job(
        req, request_id=rid, conversation=conversation, owner=owner, created=0.0
    )
    encrypted = _ENCRYPTED in (req.include or [])
    signer = state.signer if encrypted else None
    echo = openai_responses.skeleton(
        req, rid, 0
    )  # built before submit: every check passes before enqueueing
    job = await submit(state, job, owner=owner)
    headers = {"x-request-id": rid}
    ignored = openai_responses.tool_set(req).ignored
    if ignored:  # hosted tools were accepted but not offered to the model: say which
        headers[openai_responses.IGNORED_TOOLS_HEADER] = ",".join(ignored)
    if fields := openai_responses.ignored_fields(raw, req):
        headers[IGNORED_FIELDS_HEADER] = ",".join(fields)
    echo = msgspec.structs.replace(echo, created_at=int(job.created))
    if echo.store:
        items = openai_responses.input_items(req.input, rid)
        await responses_store.save(state, owner, echo, items, include_encrypted=encrypted)
    if echo.background:  # generation goes on without this connection; GET reads it later
        return _json(msgspec.structs.replace(echo, status="queued"), rid, headers)
    if req.stream:
        ctx = openai_responses.Context(skeleton=echo, signer=signer)
        projector = openai_responses.Projector(ctx)
        return sse_response(state, request, rid, projector, headers=headers)
    completion = fold(await collect_events(state, request, rid))
    error = completion.error
    if error is not None and completion.start is None and error.kind != "cancelled":
        raise service_error(error)  # rejected before generation: an HTTP error
    # (cancelled before generation is a Response with status "cancelled", as after the start)
    ended = await responses_store.completed_at(state, rid)
    body = openai_responses.render(completion, echo, completed_at=ended, signer=signer)
    return _json(body, rid, headers)


@router.post("/input_tokens")
async def count_input_tokens(request: Request) -> Response:
    """Count the input tokens a create request would use, with the model's template."""
    state = get_state(request)
    owner = await authenticate(request)
    req = openai_responses.parse_request(await request.body())
    history = []
    if req.previous_response_id is not None:
        history = await responses_store.conversation(state, req.previous_response_id, owner)
    conversation = openai_responses.input_messages(req, history, state.signer)
    job = openai_responses.build_job(
        req, request_id=new_request_id("resp"), conversation=conversation, owner=owner, created=0
    )
    loaded = await state.cards.get(job.model)
    try:
        count = await asyncio.to_thread(loaded.renderer.count_tokens, job)
    except ValueError as exc:  # TemplateError and tokenizer failures: the input is at fault
        raise InvalidRequest(f"could not render the conversation: {exc}", param="input") from exc
    body = {"object": "response.input_tokens", "input_tokens": count}
    return Response(msgspec.json.encode(body), media_type="application/json")


@router.get("/{response_id}/input_items")
async def list_input_items(
    request: Request,
    response_id: str,
    after: str | None = None,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    """List the input items of a stored response (``client.responses.input_items.list``)."""
    state = get_state(request)
    owner = await authenticate(request)
    record = await load_owned(state, responses_store.RESPONSES, response_id, owner)
    body = openai_responses.page(record.input_items, order=order, after=after, limit=limit)
    return _json(body, response_id)


@router.get("/{response_id}")
async def retrieve_response(
    request: Request, response_id: str, stream: bool = False, starting_after: int = -1
) -> Response:
    """Retrieve a stored response, or re-stream its events after ``starting_after``."""
    state = get_state(request)
    owner = await authenticate(request)
    record = await load_owned(state, responses_store.RESPONSES, response_id, owner)
    if stream:
        ctx = openai_responses.Context(
            skeleton=record.skeleton,
            starting_after=starting_after,
            signer=responses_store.signer_for(state, record),
        )
        projector = openai_responses.Projector(ctx)
        headers = {"x-request-id": response_id}
        # An observer leaving (e.g. of a background response) must not stop the generation.
        return sse_response(
            state, request, response_id, projector, headers=headers, cancel_on_disconnect=False
        )
    return _json(await responses_store.current(state, record), response_id)


@router.delete("/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    """Delete a stored response."""
    state = get_state(request)
    owner = await authenticate(request)
    record = await load_owned(state, responses_store.RESPONSES, response_id, owner)
    await responses_store.delete(state, record)
    return _json({"id": response_id, "object": "response", "deleted": True}, response_id)


@router.post("/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    """Cancel an in-progress response; returns it once the worker has stopped (or as it is)."""
    state = get_state(request)
    owner = await authenticate(request)
    record = await load_owned(state, responses_store.RESPONSES, response_id, owner)
    response = await responses_store.current(state, record)
    if response.status != "in_progress":
        raise InvalidRequest(f"Cannot cancel a response with status '{response.status}'")
    await cancel(state, response_id)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_CANCEL_WAIT_S):
            async for _ in tail(state, response_id):
                pass
    return _json(await responses_store.current(state, record), response_id)
