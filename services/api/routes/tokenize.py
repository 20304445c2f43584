"""``POST /tokenize`` and ``POST /detokenize``: the model's tokenizer, as vLLM serves it.

A raw prompt tokenizes exactly as ``/v1/completions`` tokenizes it, and messages exactly as
``/v1/chat/completions`` renders them (``services.api.submit.render_prompt``), so ``count`` is
what a request of that shape would be charged. Only the model's card is needed, not a live
worker: the API holds every card's tokenizer. Authentication already ran as the router's
dependency; errors leave in OpenAI's envelope (``error_handlers``).
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Request, Response

from services.api.state import get_state
from services.api.submit import render_prompt
from services.api.wire import openai_completions
from services.api.wire.tokenize import (
    DetokenizeResponse,
    TokenizeResponse,
    parse_detokenize,
    parse_tokenize,
)
from shared.errors import InvalidRequest

__all__ = ["router"]

router = APIRouter()

_ENCODER = msgspec.json.Encoder()


def _json(body: msgspec.Struct) -> Response:
    return Response(_ENCODER.encode(body), media_type="application/json")


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """Token ids of a raw prompt or of a conversation rendered with the chat template."""
    state = get_state(request)
    parsed = parse_tokenize(await request.body())
    loaded = await state.cards.get(parsed.model)
    if parsed.chat is not None:
        ids = list((await render_prompt(loaded.renderer, parsed.chat)).token_ids)
    else:
        assert parsed.prompt is not None
        ids = await asyncio.to_thread(
            openai_completions.raw_ids,
            loaded.renderer,
            parsed.prompt,
            bos=parsed.add_special_tokens,
        )
    strs = openai_completions.token_strings(loaded.tokenizer, ids)
    return _json(
        TokenizeResponse(
            count=len(ids),
            max_model_len=loaded.card.context_length,
            tokens=ids,
            token_strs=strs if parsed.return_token_strs else None,
        )
    )


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """The text of token ids (special tokens included, as the model would read them)."""
    state = get_state(request)
    parsed = parse_detokenize(await request.body())
    tokenizer = (await state.cards.get(parsed.model)).tokenizer
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    for i, token in enumerate(parsed.tokens):
        if not 0 <= token < vocab:
            raise InvalidRequest(f"token id {token} is not in [0, {vocab})", param=f"tokens[{i}]")
    text = tokenizer.decode(parsed.tokens, skip_special_tokens=False)
    return _json(DetokenizeResponse(prompt=text))
