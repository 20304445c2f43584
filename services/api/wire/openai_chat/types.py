"""OpenAI Chat Completions response Structs: the ``chat.completion`` body and its chunks.

Owns the outbound wire shapes (the shapes of the openai SDK's ``ChatCompletion`` and
``ChatCompletionChunk``) and the ``Context`` a request contributes to them; ``render`` and the
projector fill them from events. Unset fields are omitted on encode, because the SDK
concatenates every string field of a delta it receives.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatFinishReason",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "CompletionTokensDetails",
    "CompletionUsage",
    "Context",
    "Delta",
    "FunctionDelta",
    "FunctionOut",
    "LogprobOut",
    "PromptTokensDetails",
    "ReasoningField",
    "ResponseMessage",
    "ToolCallDelta",
    "ToolCallOut",
    "TopLogprobOut",
]

ReasoningField = Literal["reasoning_content", "reasoning", "both"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(msgspec.Struct):
    """``usage.prompt_tokens_details``: cached prompt tokens (a subset of prompt_tokens)."""

    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct):
    """``usage.completion_tokens_details``: reasoning tokens (a subset of completion_tokens)."""

    reasoning_tokens: int


class CompletionUsage(msgspec.Struct):
    """Token accounting, in the non-streaming body and the final ``choices: []`` chunk."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class TopLogprobOut(msgspec.Struct):
    """One alternative in ``top_logprobs``."""

    token: str
    logprob: float
    bytes: list[int] | None


class LogprobOut(msgspec.Struct):
    """Log-probability of one sampled token."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(msgspec.Struct):
    """``choices[].logprobs``; the SDK concatenates ``content`` across chunks."""

    content: list[LogprobOut] | None
    refusal: None = None


class FunctionDelta(msgspec.Struct):
    """``tool_calls[].function`` in a delta: ``name`` only in the call's first delta."""

    name: str | UnsetType = UNSET
    arguments: str = ""


class ToolCallDelta(msgspec.Struct):
    """A tool-call delta: ``id`` and ``type`` only in the call's first delta."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: FunctionDelta = msgspec.field(default_factory=FunctionDelta)


class Delta(msgspec.Struct):
    """``choices[].delta``; unset fields are omitted, since the SDK concatenates strings."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    refusal: UnsetType | None = UNSET  # null on the first chunk, as OpenAI sends it
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChunkChoice(msgspec.Struct):
    """The choice a chunk carries (``index``: which one, with ``n`` > 1)."""

    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One streamed chunk; ``usage`` is omitted unless the client asked for usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | UnsetType | None = UNSET


class FunctionOut(msgspec.Struct):
    """A complete tool call's function: name and JSON arguments as text."""

    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    """A complete tool call in the non-streaming message."""

    id: str
    function: FunctionOut
    type: Literal["function"] = "function"


class ResponseMessage(msgspec.Struct):
    """The assistant message; content is null when the turn is only tool calls."""

    content: str | None
    role: Literal["assistant"] = "assistant"
    refusal: None = None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class Choice(msgspec.Struct):
    """One choice of a non-streaming response."""

    index: int
    message: ResponseMessage
    finish_reason: ChatFinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """The non-streaming response body."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    system_fingerprint: None = None


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the projector and ``render`` need besides the events."""

    id: str  # "chatcmpl-…", the same on every chunk
    created: int  # unix seconds, the same on every chunk
    model: str
    include_usage: bool = False
    include_reasoning: bool = False
    reasoning_field: ReasoningField = "reasoning_content"
    # reasoning_format "inline": the model's open/close markers; reasoning then goes into
    # ``content`` between them, as the model wrote it, instead of into ``reasoning_field``
    reasoning_markers: tuple[str, str] | None = None
    logprobs: bool = False
    index: int = 0  # the choice a projector streams (``choices[].index``)
    n: int = 1  # choices in the request: with more than one, the usage chunk is the merge's
