"""``POST /v1/chat/completions``: parse, submit, then stream or collect. Nothing else.

Authentication already ran as the router's dependency (``authenticate`` caches the owner id on
the request); parsing, projection and rendering live in ``services.api.wire.openai_chat*``.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request, Response

from services.api.app import get_state
from services.api.auth import authenticate
from services.api.streaming import collect, sse_response
from services.api.submit import new_request_id, submit
from services.api.wire.openai_chat import ChatContext, ChatProjector, error_from_event, render
from services.api.wire.openai_chat_request import parse_chat_request
from shared.accumulate import fold

__all__ = ["router"]

router = APIRouter()

_TRUTHY = {"1", "true", "yes", "on"}


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """Create a chat completion (OpenAI Chat Completions wire format)."""
    state = get_state(request)
    owner = await authenticate(request)
    parsed = parse_chat_request(
        await request.body(),
        request_id=new_request_id("chatcmpl"),
        include_reasoning_header=request.headers.get("x-include-reasoning", "").lower() in _TRUTHY,
    )
    job = await submit(state, parsed.job, owner=owner)
    options = parsed.options
    ctx = ChatContext(
        id=job.request_id,
        created=int(job.created),
        model=job.model,
        include_usage=options.include_usage,
        include_reasoning=options.include_reasoning,
        reasoning_field=state.settings.chat_reasoning_field,
        logprobs=options.logprobs,
    )
    headers = {"x-request-id": job.request_id}
    if options.stream:
        return sse_response(state, request, job.request_id, ChatProjector(ctx), headers=headers)
    completion = fold(await collect(state, request, job.request_id))
    if completion.error is not None:
        raise error_from_event(completion.error)
    body = msgspec.json.encode(render(completion, ctx))
    return Response(body, media_type="application/json", headers=headers)
