"""OpenAI legacy Completions response Structs: the ``text_completion`` body and its chunks.

The openai SDK parses both with one model (``Completion``), so one Struct serves the body and
every streamed chunk: in a chunk ``finish_reason`` is null until the last, and ``usage`` is
omitted unless the client asked for it (then null on every chunk but the final ``choices: []``
one), as OpenAI sends it. ``logprobs`` is the legacy shape: parallel lists, with
``top_logprobs`` as ``{token: logprob}`` dicts and ``text_offset`` as character offsets into the
choice's text (the echoed prompt included).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from services.api.wire.openai_chat.types import CompletionUsage

__all__ = [
    "CompletionChoice",
    "CompletionFinishReason",
    "Context",
    "Logprobs",
    "TextCompletion",
]

CompletionFinishReason = Literal["stop", "length"]


class Logprobs(msgspec.Struct):
    """``choices[].logprobs`` in the legacy shape (one entry per token, lists in parallel).

    An echoed prompt token has ``null`` in ``token_logprobs`` and ``top_logprobs``: the worker
    scores only the tokens it samples, and null is what OpenAI sends for a token with no score
    (its first prompt token), so clients already handle it.
    """

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    """One choice (``index``: which one, with ``n`` > 1)."""

    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: CompletionFinishReason | None = None


class TextCompletion(msgspec.Struct, kw_only=True):
    """The non-streaming body, and each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | UnsetType | None = UNSET
    system_fingerprint: None = None


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the projector and ``render`` need besides the events."""

    id: str  # "cmpl-…", the same on every chunk
    created: int  # unix seconds, the same on every chunk
    model: str
    include_usage: bool = False
    logprobs: bool = False  # the client sent ``logprobs`` (any int, 0 included)
    echo: str | None = None  # the prompt text that leads the choice's text (``echo``)
    echo_tokens: list[str] = []  # its tokens, listed under ``logprobs`` with null scores
    index: int = 0  # the choice a projector streams (``choices[].index``)
    n: int = 1  # choices in the request: with more than one, the usage chunk is the merge's
    prompts: int = 1  # a batch's prompts: each run of n / prompts choices reads its own
