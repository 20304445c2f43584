"""OpenAI Chat Completions routes: create, and (from the event log) retrieve and resume.

Thin: parse (``wire.openai_chat``), submit, then stream through the shared pipeline or render
the fold of the same events. Authentication already ran as the
router's dependency. Because every answer is a durable event log, ``GET
/v1/chat/completions/{id}`` returns a request's ``chat.completion`` (the openai SDK's
``chat.completions.retrieve``; it waits if still generating) and ``GET
/v1/chat/completions/{id}/events`` re-streams it as chunks, resuming after ``Last-Event-ID``.
Both serve only the key that created the request.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request, Response

from services.api.auth import authenticate
from services.api.ownership import REQUESTS, RETRIEVABLE, load_owned
from services.api.replay import catch_up
from services.api.state import AppState, get_state
from services.api.streaming import collect_events, sse_response
from services.api.submit import new_request_id, submit
from services.api.wire import openai_chat
from services.api.wire.common import IGNORED_TOOLS_HEADER, service_error
from services.api.wire.extra_fields import IGNORED_FIELDS_HEADER
from shared.accumulate import fold
from shared.jobs import GenerateRequest

__all__ = ["router"]

router = APIRouter()

_TRUTHY = {"1", "true", "yes", "on"}


def _context(state: AppState, job: GenerateRequest, *, include_usage: bool) -> openai_chat.Context:
    return openai_chat.Context(
        id=job.request_id,
        created=int(job.created),
        model=job.model,
        include_usage=include_usage,
        include_reasoning=job.reasoning.visible,
        reasoning_field=state.settings.chat_reasoning_field,
        logprobs=job.sampling.logprobs,
    )


async def _completion(
    state: AppState, request: Request, ctx: openai_chat.Context, headers: dict[str, str]
) -> Response:
    completion = fold(await collect_events(state, request, ctx.id))
    if completion.error is not None:
        raise service_error(completion.error)
    body = msgspec.json.encode(openai_chat.render(completion, ctx))
    return Response(body, media_type="application/json", headers=headers)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """Create a chat completion, streamed (SSE chunks) or not."""
    state = get_state(request)
    parsed = openai_chat.parse_request(
        await request.body(),
        request_id=new_request_id("chatcmpl"),
        include_reasoning_header=request.headers.get("x-include-reasoning", "").lower() in _TRUTHY,
    )
    job = await submit(state, parsed.job, owner=await authenticate(request))
    ctx = _context(state, job, include_usage=parsed.options.include_usage)
    headers = {"x-request-id": job.request_id}
    if parsed.ignored_tools:
        headers[IGNORED_TOOLS_HEADER] = ",".join(parsed.ignored_tools)
    if parsed.ignored_fields:
        headers[IGNORED_FIELDS_HEADER] = ",".join(parsed.ignored_fields)
    if not parsed.options.stream:
        return await _completion(state, request, ctx, headers)
    return sse_response(state, request, job.request_id, openai_chat.Projector(ctx), headers=headers)


@router.get("/v1/chat/completions/{rid}")
async def retrieve_chat_completion(rid: str, request: Request) -> Response:
    """The ``chat.completion`` of a stored request (waits for the end if still generating)."""
    state = get_state(request)
    job = await load_owned(state, RETRIEVABLE, rid, await authenticate(request))
    ctx = _context(state, job, include_usage=True)
    return await _completion(state, request, ctx, {"x-request-id": rid})


@router.get("/v1/chat/completions/{rid}/events")
async def replay_chat_completion(rid: str, request: Request) -> Response:
    """Re-stream a stored request as chunks, from the start or after ``Last-Event-ID``."""
    state = get_state(request)
    job = await load_owned(state, REQUESTS, rid, await authenticate(request))
    usage = request.query_params.get("include_usage", "").lower() in _TRUTHY
    projector = openai_chat.Projector(_context(state, job, include_usage=usage))
    # Caught up, the role and each tool call's id/name are not sent twice (the SDK would
    # concatenate them).
    after = await catch_up(state, request, rid, projector)
    headers = {"x-request-id": rid}
    return sse_response(state, request, rid, projector, after=after, headers=headers)
