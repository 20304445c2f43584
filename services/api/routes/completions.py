"""OpenAI legacy Completions route: ``POST /v1/completions``.

Thin: parse (``wire.openai_completions``), tokenize the raw prompt with the model's tokenizer
(no chat template; fill-in-the-middle with ``suffix``), submit the tokenized prompt, then stream
through the shared pipeline or render the fold of the same events. Authentication already ran
as the router's dependency. With ``n`` > 1 the choices are requests of their own, merged into
``choices[i]`` (``services.api.choices``).
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import Request, Response

from services.api.auth import authenticate
from services.api.choices import ChoicesPlan, collect_choices
from services.api.formats import FormatRouter
from services.api.state import AppState, get_state
from services.api.streaming import collect_events, count_reads, plan_response, sse_response
from services.api.submit import new_request_id, submit
from services.api.wire import openai_completions, openai_errors
from services.api.wire.choices import ChoiceMerge
from services.api.wire.common import service_error
from shared.accumulate import fold
from shared.jobs import choice_id

__all__ = ["router"]

router = FormatRouter("/v1/completions", "openai_completions", openai_errors.error_body)


@router.post("")
async def create_completion(request: Request) -> Response:
    """Create a text completion, streamed (SSE chunks) or not."""
    state = get_state(request)
    parsed = openai_completions.parse_request(
        await request.body(), request_id=new_request_id("cmpl")
    )
    owner = await authenticate(request)
    renderer = (await state.cards.get(parsed.job.model)).renderer
    # Tokenizing a long prompt takes a while: off the event loop, as chat's rendering is.
    prompt = await asyncio.to_thread(
        openai_completions.build_prompt, renderer, parsed.prompt, parsed.suffix
    )
    job = await submit(state, parsed.job, owner=owner, prompt=prompt)
    options = parsed.options
    echo_tokens: list[str] = []
    if options.echo and options.logprobs is not None:
        ids = openai_completions.echo_ids(renderer, parsed.prompt)
        echo_tokens = openai_completions.token_strings(renderer.tokenizer, ids)
    ctx = openai_completions.Context(
        id=job.request_id,
        created=int(job.created),
        model=job.model,
        include_usage=options.include_usage,
        logprobs=options.logprobs is not None,
        echo=(prompt.text if isinstance(parsed.prompt, list) else parsed.prompt)
        if options.echo
        else None,
        echo_tokens=echo_tokens,
    )
    headers = {"x-request-id": job.request_id}
    rids = [choice_id(job.request_id, i) for i in range(job.n)]
    if options.stream:
        return _stream(state, request, ctx, rids, headers)
    if job.n == 1:
        folds = [fold(await collect_events(state, request, job.request_id))]
    else:
        folds = [fold(events) for events in await collect_choices(state, request, rids)]
    if (error := next((c.error for c in folds if c.error is not None), None)) is not None:
        raise service_error(error)
    body = msgspec.json.encode(openai_completions.render_choices(folds, ctx))
    return Response(body, media_type="application/json", headers=headers)


def _stream(
    state: AppState,
    request: Request,
    ctx: openai_completions.Context,
    rids: list[str],
    headers: dict[str, str],
) -> Response:
    if len(rids) == 1:
        projector = openai_completions.Projector(ctx)
        return sse_response(state, request, ctx.id, projector, headers=headers)
    n = len(rids)
    choices = [
        openai_completions.Projector(msgspec.structs.replace(ctx, index=i, n=n)) for i in range(n)
    ]
    merge = ChoiceMerge(choices, lambda usage: openai_completions.usage_chunk(ctx, usage))
    count_reads(state, request, resumed=False)
    return plan_response(
        state, ChoicesPlan(state, rids, merge, cancel_on_failure=True), headers=headers
    )
