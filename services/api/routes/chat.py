"""OpenAI Chat Completions routes: create, and (from the event log) retrieve and resume.

Thin: parse (``wire.openai_chat``), submit, then stream through the shared pipeline or render
the fold of the same events. Authentication already ran as the
router's dependency. Because every answer is a durable event log, ``GET
/v1/chat/completions/{id}`` returns a request's ``chat.completion`` (the openai SDK's
``chat.completions.retrieve``; it waits if still generating) and ``GET
/v1/chat/completions/{id}/events`` re-streams it as chunks, resuming after ``Last-Event-ID``.
Both serve only the key that created the request. A request with ``n`` > 1 is n choices, each
its own request (``services.api.choices``), merged here into ``choices[i]`` by every route.
"""

from __future__ import annotations

import msgspec
from fastapi import Request, Response

from services.api.auth import authenticate
from services.api.choices import ChoicesPlan, catch_up_choices, collect_choices, owned_choices
from services.api.formats import FormatRouter
from services.api.ownership import REQUESTS, RETRIEVABLE, load_owned
from services.api.replay import catch_up
from services.api.state import AppState, get_state
from services.api.streaming import collect_events, count_reads, plan_response, sse_response
from services.api.submit import new_request_id, submit
from services.api.wire import openai_chat, openai_errors
from services.api.wire.choices import ChoiceMerge
from services.api.wire.common import IGNORED_TOOLS_HEADER, service_error
from services.api.wire.extra_fields import IGNORED_FIELDS_HEADER
from services.api.wire.openai_chat.projector import usage_chunk
from shared.accumulate import fold
from shared.errors import ModelNotFound
from shared.jobs import GenerateRequest, choice_id

__all__ = ["router"]

router = FormatRouter("/v1/chat/completions", "openai_chat", openai_errors.error_body)

_TRUTHY = {"1", "true", "yes", "on"}


async def _context(
    state: AppState, job: GenerateRequest, *, include_usage: bool
) -> openai_chat.Context:
    return openai_chat.Context(
        id=job.request_id,
        created=int(job.created),
        model=job.model,
        include_usage=include_usage,
        include_reasoning=job.reasoning.visible,
        reasoning_field=state.settings.chat_reasoning_field,
        reasoning_markers=await _inline_markers(state, job),
        logprobs=job.sampling.logprobs,
    )


async def _inline_markers(state: AppState, job: GenerateRequest) -> tuple[str, str] | None:
    """The model's reasoning markers for ``reasoning_format: "inline"``: found in its tokenizer
    like the split itself. A model without them, or no longer served when a stored request is
    replayed, shows its reasoning in the reasoning field instead."""
    if not job.reasoning.inline:
        return None
    try:
        markers = (await state.cards.get(job.model)).card.reasoning
    except ModelNotFound:
        return None
    return None if markers is None else (markers.open, markers.close)


def _merge(ctx: openai_chat.Context, job: GenerateRequest) -> ChoiceMerge:
    n = job.n
    choices = [openai_chat.Projector(msgspec.structs.replace(ctx, index=i, n=n)) for i in range(n)]
    # a legacy Completions batch replayed as Chat keeps counting each of its prompts once
    return ChoiceMerge(choices, lambda usage: usage_chunk(ctx, usage), prompts=job.prompts)


async def _completion(
    state: AppState,
    request: Request,
    ctx: openai_chat.Context,
    headers: dict[str, str],
    rids: list[str],
) -> Response:
    if len(rids) == 1:
        folds = [fold(await collect_events(state, request, ctx.id))]
    else:
        folds = [fold(events) for events in await collect_choices(state, request, rids)]
    if (error := next((c.error for c in folds if c.error is not None), None)) is not None:
        raise service_error(error)
    body = msgspec.json.encode(openai_chat.render_choices(folds, ctx))
    return Response(body, media_type="application/json", headers=headers)


@router.post("")
async def create_chat_completion(request: Request) -> Response:
    """Create a chat completion, streamed (SSE chunks) or not."""
    state = get_state(request)
    parsed = openai_chat.parse_request(
        await request.body(),
        request_id=new_request_id("chatcmpl"),
        include_reasoning_header=request.headers.get("x-include-reasoning", "").lower() in _TRUTHY,
    )
    job = await submit(state, parsed.job, owner=await authenticate(request))
    ctx = await _context(state, job, include_usage=parsed.options.include_usage)
    headers = {"x-request-id": job.request_id}
    if parsed.ignored_tools:
        headers[IGNORED_TOOLS_HEADER] = ",".join(parsed.ignored_tools)
    if parsed.ignored_fields:
        headers[IGNORED_FIELDS_HEADER] = ",".join(parsed.ignored_fields)
    rids = [choice_id(job.request_id, i) for i in range(job.n)]
    if not parsed.options.stream:
        return await _completion(state, request, ctx, headers, rids)
    if job.n == 1:
        projector = openai_chat.Projector(ctx)
        return sse_response(state, request, job.request_id, projector, headers=headers)
    count_reads(state, request, resumed=False)
    plan = ChoicesPlan(state, rids, _merge(ctx, job), cancel_on_failure=True)
    return plan_response(state, plan, headers=headers)


@router.get("/{rid}")
async def retrieve_chat_completion(rid: str, request: Request) -> Response:
    """The ``chat.completion`` of a stored request (waits for the end if still generating)."""
    state = get_state(request)
    owner = await authenticate(request)
    job = await load_owned(state, RETRIEVABLE, rid, owner)
    ctx = await _context(state, job, include_usage=True)
    rids = await owned_choices(state, job, owner) if job.choice == 0 else [rid]
    return await _completion(state, request, ctx, {"x-request-id": rid}, rids)


@router.get("/{rid}/events")
async def replay_chat_completion(rid: str, request: Request) -> Response:
    """Re-stream a stored request as chunks, from the start or after ``Last-Event-ID``."""
    state = get_state(request)
    owner = await authenticate(request)
    job = await load_owned(state, REQUESTS, rid, owner)
    usage = request.query_params.get("include_usage", "").lower() in _TRUTHY
    ctx = await _context(state, job, include_usage=usage)
    headers = {"x-request-id": rid}
    if job.n > 1 and job.choice == 0:
        rids = await owned_choices(state, job, owner)
        merge = _merge(ctx, job)
        # Each choice's log caught up to its own position in the client's Last-Event-ID.
        positions = await catch_up_choices(state, request, rids, merge)
        count_reads(state, request, resumed=any(p != "0-0" for p in positions))
        return plan_response(state, ChoicesPlan(state, rids, merge, positions), headers=headers)
    projector = openai_chat.Projector(ctx)
    # Caught up, the role and each tool call's id/name are not sent twice (the SDK would
    # concatenate them).
    after = await catch_up(state, request, rid, projector)
    return sse_response(state, request, rid, projector, after=after, headers=headers)
