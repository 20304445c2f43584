"""Anthropic Messages routes: create, count tokens, and (a sluice extension) replay.

Thin: parse (``wire.anthropic_messages``), submit, then stream through the shared pipeline or render
the fold of the same events. Query strings such as Claude Code's ``?beta=true`` and any
``anthropic-version``/``anthropic-beta`` headers are ignored; errors leave through the app's
handlers in Anthropic's envelope. Because every answer is a durable event log, ``GET
/v1/messages/{id}`` and ``GET /v1/messages/{id}/events`` re-project any request the caller's key
created (in any format) as an Anthropic message or stream, and the latter resumes after
``Last-Event-ID``.
"""

from __future__ import annotations

import msgspec
from fastapi import Request, Response

from services.api.auth import authenticate
from services.api.formats import FormatRouter
from services.api.ownership import REQUESTS, RETRIEVABLE, Stored, load_owned
from services.api.replay import catch_up
from services.api.state import AppState, get_state
from services.api.streaming import collect_events, sse_response
from services.api.submit import new_request_id, render_prompt, submit
from services.api.wire import anthropic_messages
from services.api.wire.common import IGNORED_TOOLS_HEADER
from services.api.wire.extra_fields import IGNORED_FIELDS_HEADER
from shared.accumulate import fold
from shared.jobs import GenerateRequest, Job

__all__ = ["router"]

router = FormatRouter("/v1/messages", "anthropic_messages", anthropic_messages.error_body)
_JSON = msgspec.json.Encoder()
_PING = anthropic_messages.PING


def _context(state: AppState, job: GenerateRequest) -> anthropic_messages.Context:
    return anthropic_messages.Context(
        message_id=job.request_id,
        model=job.model,
        show_thinking=job.reasoning.visible,
        signer=state.signer,
    )


@router.post("")
async def create_message(request: Request) -> Response:
    """Create a message, streamed as Anthropic SSE when ``stream`` is true."""
    state = get_state(request)
    owner = await authenticate(request)
    raw = await request.body()
    req = anthropic_messages.parse_request(raw)
    req = anthropic_messages.restore_thinking(req, state.signer)
    job = anthropic_messages.build_job(req, request_id=new_request_id("msg"))
    job = await submit(state, job, owner=owner)
    rid, ctx = job.request_id, _context(state, job)
    headers = {"request-id": rid}
    ignored = anthropic_messages.ignored_tools(req)
    if ignored:
        headers[IGNORED_TOOLS_HEADER] = ",".join(ignored)
    if fields := anthropic_messages.ignored_fields(raw, req):
        headers[IGNORED_FIELDS_HEADER] = ",".join(fields)
    if req.stream:
        projector = anthropic_messages.Projector(ctx)
        return sse_response(state, request, rid, projector, keepalive=_PING, headers=headers)
    events = await collect_events(state, request, rid)
    body = anthropic_messages.render(fold(events), ctx)
    return Response(_JSON.encode(body), media_type="application/json", headers=headers)


@router.post("/count_tokens")
async def count_tokens(request: Request) -> Response:
    """Count the prompt tokens a request renders to, with the model's template and tokenizer."""
    state = get_state(request)
    req = anthropic_messages.parse_count_tokens_request(await request.body())
    loaded = await state.cards.get(req.model)
    job = anthropic_messages.build_job(req, request_id=new_request_id("msg"))
    count = len((await render_prompt(loaded.renderer, job)).token_ids)
    return Response(_JSON.encode({"input_tokens": count}), media_type="application/json")


async def _stored(
    state: AppState, request: Request, rid: str, stored: Stored[Job] = REQUESTS
) -> anthropic_messages.Context:
    return _context(state, await load_owned(state, stored, rid, await authenticate(request)))


@router.get("/{rid}")
async def retrieve_message(rid: str, request: Request) -> Response:
    """The finished message of a stored request (waits for the end if still generating)."""
    state = get_state(request)
    ctx = await _stored(state, request, rid, RETRIEVABLE)
    body = anthropic_messages.render(fold(await collect_events(state, request, rid)), ctx)
    return Response(_JSON.encode(body), media_type="application/json", headers={"request-id": rid})


@router.get("/{rid}/events")
async def replay_message(rid: str, request: Request) -> Response:
    """Stream a stored request as Anthropic SSE, from the start or after ``Last-Event-ID``."""
    state = get_state(request)
    ctx = await _stored(state, request, rid)
    projector = anthropic_messages.Projector(ctx)
    # Caught up, block indexes and the single message_start continue exactly where the
    # interrupted stream stopped.
    after = await catch_up(state, request, rid, projector)
    headers = {"request-id": rid}
    return sse_response(
        state, request, rid, projector, after=after, keepalive=_PING, headers=headers
    )
