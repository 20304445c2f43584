"""Anthropic Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Thin: parse (``wire.anthropic_messages_request``), submit, then stream through the shared
pipeline or render the fold of the same events (``wire.anthropic_messages``). Query strings
such as Claude Code's ``?beta=true`` and any ``anthropic-version``/``anthropic-beta`` headers are
ignored; errors leave through the app's handlers in Anthropic's envelope.
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Request, Response

from services.api.app import get_state
from services.api.auth import authenticate
from services.api.streaming import collect, sse_response
from services.api.submit import new_request_id, submit
from services.api.wire.anthropic_messages import PING, AnthropicProjector, MessageContext, render
from services.api.wire.anthropic_messages_request import (
    build_job,
    parse_count_tokens_request,
    parse_messages_request,
)
from shared.accumulate import fold
from shared.errors import InvalidRequest

__all__ = ["router"]

router = APIRouter()
_JSON = msgspec.json.Encoder()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    """Create a message, streamed as Anthropic SSE when ``stream`` is true."""
    state = get_state(request)
    owner = await authenticate(request)
    req = parse_messages_request(await request.body())
    job = await submit(state, build_job(req, request_id=new_request_id("msg")), owner=owner)
    rid = job.request_id
    ctx = MessageContext(message_id=rid, model=job.model, show_thinking=job.reasoning.visible)
    headers = {"request-id": rid}
    if req.stream:
        projector = AnthropicProjector(ctx)
        return sse_response(state, request, rid, projector, keepalive=PING, headers=headers)
    events = await collect(state, request, rid)
    body = render(fold(events), ctx)
    return Response(_JSON.encode(body), media_type="application/json", headers=headers)


@router.head("/")
async def probe() -> Response:
    """Claude Code probes ``HEAD /`` before its first request; any 200 will do."""
    return Response()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """Count the prompt tokens a request renders to, with the model's template and tokenizer."""
    state = get_state(request)
    req = parse_count_tokens_request(await request.body())
    loaded = await state.cards.get(req.model)
    job = build_job(req, request_id=new_request_id("msg"))
    try:
        count = await asyncio.to_thread(loaded.renderer.count_tokens, job)
    except ValueError as exc:  # TemplateError and tokenizer failures: the input is at fault
        raise InvalidRequest(f"could not render the conversation: {exc}", param="messages") from exc
    return Response(_JSON.encode({"input_tokens": count}), media_type="application/json")
