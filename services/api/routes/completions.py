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
from services.api.wire.openai_completions.request import CompletionOptions
from shared.accumulate import fold
from shared.jobs import choice_id
from shared.prompt import PromptRenderer, RenderedPrompt

__all__ = ["router"]

router = FormatRouter("/v1/completions", "openai_completions", openai_errors.error_body)


@router.post("")
async def create_completion(request: Request) -> Response:
    """Create a text completion (or, for a prompt batch, one per prompt), streamed or not."""
    state = get_state(request)
    parsed = openai_completions.parse_request(
        await request.body(), request_id=new_request_id("cmpl")
    )
    owner = await authenticate(request)
    renderer = (await state.cards.get(parsed.job.model)).renderer
    # Tokenizing a long prompt takes a while: off the event loop, as chat's rendering is.
    prompts = await asyncio.to_thread(
        lambda: [
            openai_completions.build_prompt(renderer, p, parsed.suffix) for p in parsed.prompts
        ]
    )
    job = await submit(state, parsed.job, owner=owner, prompt=prompts)
    options = parsed.options
    ctx = openai_completions.Context(
        id=job.request_id,
        created=int(job.created),
        model=job.model,
        include_usage=options.include_usage,
        logprobs=options.logprobs is not None,
        n=job.n,
        prompts=job.prompts,
    )
    echoes = [
        _echoed(ctx, renderer, raw, p, options)
        for raw, p in zip(parsed.prompts, prompts, strict=True)
    ]
    per_prompt = job.n // job.prompts
    # choice i answers prompt i // per_prompt (OpenAI's index = prompt * n + j)
    contexts = [msgspec.structs.replace(echoes[i // per_prompt], index=i) for i in range(job.n)]
    headers = {"x-request-id": job.request_id}
    rids = [choice_id(job.request_id, i) for i in range(job.n)]
    if options.stream:
        return _stream(state, request, contexts, rids, headers)
    if job.n == 1:
        folds = [fold(await collect_events(state, request, job.request_id))]
    else:
        folds = [fold(events) for events in await collect_choices(state, request, rids)]
    if (error := next((c.error for c in folds if c.error is not None), None)) is not None:
        raise service_error(error)
    body = msgspec.json.encode(openai_completions.render_choices(folds, contexts))
    return Response(body, media_type="application/json", headers=headers)


def _echoed(
    ctx: openai_completions.Context,
    renderer: PromptRenderer,
    raw: str | list[int],
    prompt: RenderedPrompt,
    options: CompletionOptions,
) -> openai_completions.Context:
    """``ctx`` with the echo of one prompt: its text, and its tokens when logprobs are asked."""
    if not options.echo:
        return ctx
    tokens: list[str] = []
    if options.logprobs is not None:
        ids = openai_completions.echo_ids(renderer, raw)
        tokens = openai_completions.token_strings(renderer.tokenizer, ids)
    text = prompt.text if isinstance(raw, list) else raw
    return msgspec.structs.replace(ctx, echo=text, echo_tokens=tokens)


def _stream(
    state: AppState,
    request: Request,
    contexts: list[openai_completions.Context],
    rids: list[str],
    headers: dict[str, str],
) -> Response:
    ctx = contexts[0]
    if len(rids) == 1:
        projector = openai_completions.Projector(ctx)
        return sse_response(state, request, ctx.id, projector, headers=headers)
    choices = [openai_completions.Projector(c) for c in contexts]
    finale = lambda usage: openai_completions.usage_chunk(ctx, usage)  # noqa: E731
    merge = ChoiceMerge(choices, finale, prompts=ctx.prompts)
    count_reads(state, request, resumed=False)
    return plan_response(
        state, ChoicesPlan(state, rids, merge, cancel_on_failure=True), headers=headers
    )
