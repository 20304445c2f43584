"""``/tokenize`` and ``/detokenize`` bodies (vLLM's shape, which llama.cpp's server shares).

``/tokenize`` takes ``{model, prompt}`` (raw text, tokenized as ``/v1/completions`` tokenizes
it) or ``{model, messages, add_generation_prompt}`` (rendered with the chat template exactly
as ``/v1/chat/completions`` renders them: the messages, ``tools`` and ``chat_template_kwargs``
go through Chat's own parser) and answers ``{count, max_model_len, tokens, token_strs}``.
``/detokenize`` takes ``{model, tokens}`` and answers ``{prompt}``. Pure: no I/O; errors are
``InvalidRequest`` with a ``param`` (OpenAI's 400, never a 422).
"""

from __future__ import annotations

import msgspec

from services.api.wire import openai_chat
from services.api.wire.common import JsonObject, WireInt, decode_body, error_location
from shared.errors import InvalidRequest
from shared.jobs import GenerateRequest

__all__ = [
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ParsedTokenize",
    "TokenizeResponse",
    "parse_detokenize",
    "parse_tokenize",
]


class _TokenizeRequest(msgspec.Struct, forbid_unknown_fields=False):
    model: str
    prompt: str | None = None
    messages: list[JsonObject] | None = None
    add_generation_prompt: bool = True
    # False: a raw prompt without the BOS sluice would prepend. A chat render is always what
    # Chat Completions would submit (its template writes its own special tokens).
    add_special_tokens: bool | None = None
    tools: list[JsonObject] | None = None
    chat_template_kwargs: JsonObject | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=False):
    """The ``/detokenize`` body."""

    model: str
    tokens: list[WireInt]


class ParsedTokenize(msgspec.Struct, frozen=True, kw_only=True):
    """A validated ``/tokenize``: a raw prompt, or a chat job to render."""

    model: str
    prompt: str | None = None  # set for ``{prompt}``
    chat: GenerateRequest | None = None  # set for ``{messages}``
    add_special_tokens: bool = True  # a raw prompt only
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    """What ``/tokenize`` answers; ``token_strs`` is null unless asked for, as vLLM's."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    """What ``/detokenize`` answers."""

    prompt: str


_TOKENIZE = msgspec.json.Decoder(_TokenizeRequest)
_DETOKENIZE = msgspec.json.Decoder(DetokenizeRequest)
_ENCODER = msgspec.json.Encoder()


def _invalid(exc: msgspec.ValidationError) -> InvalidRequest:
    message = str(exc)
    return InvalidRequest(message, param=error_location(message)[1])


def parse_tokenize(body: bytes) -> ParsedTokenize:
    """Decode a ``/tokenize`` body.

    Args:
        body: the raw request body.

    Returns:
        The prompt or the chat job (not yet rendered) and the options.

    Raises:
        InvalidRequest: bad JSON or types, neither or both of ``prompt`` and ``messages``, or
            messages Chat Completions would refuse.
    """
    req = decode_body(_TOKENIZE, body, _invalid)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("send exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        return ParsedTokenize(
            model=req.model,
            prompt=req.prompt,
            add_special_tokens=req.add_special_tokens is not False,
            return_token_strs=req.return_token_strs,
        )
    # Chat's own parser, so a conversation tokenizes exactly as it would be rendered for chat.
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs.setdefault("add_generation_prompt", req.add_generation_prompt)
    chat_body: JsonObject = {"model": req.model, "messages": req.messages}
    chat_body["chat_template_kwargs"] = kwargs
    if req.tools is not None:
        chat_body["tools"] = req.tools
    chat = openai_chat.parse_request(_ENCODER.encode(chat_body), request_id="tokenize")
    return ParsedTokenize(
        model=req.model,
        chat=chat.job,
        return_token_strs=req.return_token_strs,
    )


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    """Decode a ``/detokenize`` body.

    Args:
        body: the raw request body.

    Returns:
        The model and the token ids (checked against the vocabulary by the route).

    Raises:
        InvalidRequest: bad JSON or types.
    """
    return decode_body(_DETOKENIZE, body, _invalid)
