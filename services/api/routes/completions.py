"""OpenAI legacy Completions route: ``POST /v1/completions``.

Thin: parse (``wire.openai_completions``), tokenize the raw prompt with the model's tokenizer
(no chat template; fill-in-the-middle with ``suffix``), submit the tokenized prompt, then stream
through the shared pipeline or render the fold of the same events. Authentication already ran
as the router's dependency.
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Request, Response

from services.api.auth import authenticate
from services.api.state import get_state
from services.api.streaming import collect_events, sse_response
from services.api.submit import new_request_id, submit
from services.api.wire import openai_completions
from services.api.wire.common import service_error
from shared.accumulate import fold

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/completions")
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
    if options.stream:
        projector = openai_completions.Projector(ctx)
        return sse_response(state, request, job.request_id, projector, headers=headers)
    completion = fold(await collect_events(state, request, job.request_id))
    if completion.error is not None:
        raise service_error(completion.error)
    body = msgspec.json.encode(openai_completions.render(completion, ctx))
    return Response(body, media_type="application/json", headers=headers)
