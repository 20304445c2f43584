"""The OpenAI Responses object model: the response, its output items and its stream events.

Owns the msgspec Structs that are serialized onto the wire (and into the stored-response record)
for ``/v1/responses``. Field order follows what OpenAI sends so transcripts read naturally. Pure
data: no I/O, no parsing of client input (``request``), no projection logic (``projector``),
plus the ``Context`` a projector is built from.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from services.api.wire.openai_responses.call_types import (
    CustomToolCallInputDelta,
    CustomToolCallInputDone,
    CustomToolCallItem,
    ToolSearchCallItem,
)
from services.api.wire.openai_responses.delta_events import (
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    Logprob,
    OutputTextDelta,
    OutputTextDone,
    ReasoningSummaryPartAdded,
    ReasoningSummaryPartDone,
    ReasoningSummaryTextDelta,
    ReasoningSummaryTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    TopLogprob,
)
from services.api.wire.reasoning_tokens import ReasoningSigner

__all__ = [
    "ContentPartAdded",
    "ContentPartDone",
    "Context",
    "ErrorEvent",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "FunctionCallItem",
    "FunctionTool",
    "IncompleteDetails",
    "InputTokensDetails",
    "ItemStatus",
    "Logprob",
    "MessageItem",
    "OutputItem",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputText",
    "OutputTextDelta",
    "OutputTextDone",
    "OutputTokensDetails",
    "Part",
    "ReasoningConfig",
    "ReasoningItem",
    "ReasoningText",
    "ReasoningTextDelta",
    "ReasoningTextDone",
    "Response",
    "ResponseError",
    "ResponseLifecycle",
    "ResponseStatus",
    "ResponseUsage",
    "StreamEvent",
    "SummaryText",
    "TextConfig",
    "TextFormat",
    "ToolChoiceFunction",
    "TopLogprob",
]

_Json = dict[str, object]  # (the Response's ``object`` field shadows the builtin in its body)
ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class OutputText(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    """Answer text inside a message item."""

    annotations: list[dict[str, object]] = []
    logprobs: list[Logprob] = []
    text: str = ""


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text", kw_only=True):
    """Raw reasoning text inside a reasoning item (what open-weight servers stream)."""

    text: str = ""


class SummaryText(msgspec.Struct, tag_field="type", tag="summary_text", kw_only=True):
    """A reasoning summary part: the raw reasoning itself, when the request asks for a summary."""

    text: str = ""


Part = OutputText | ReasoningText


class MessageItem(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    """An assistant message output item."""

    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning", kw_only=True):
    """A reasoning output item carrying the raw reasoning text as ``content``."""

    id: str
    status: ItemStatus
    summary: list[SummaryText] = []
    content: list[ReasoningText] = []
    # Only with ``include: ["reasoning.encrypted_content"]``: the reasoning, signed, so it comes
    # back intact in a later request's input (``wire.reasoning_tokens``).
    encrypted_content: str | msgspec.UnsetType = msgspec.UNSET


class FunctionCallItem(
    msgspec.Struct, tag_field="type", tag="function_call", kw_only=True, omit_defaults=True
):
    """A function call output item: ``id`` is the item (``fc_``), ``call_id`` the call.

    Only ``namespace`` has a default, so only it is left out when unset, as OpenAI does.
    """

    id: str
    status: ItemStatus
    arguments: str
    call_id: str
    name: str
    namespace: str | None = None  # set for a tool declared inside a ``namespace`` tool


OutputItem = (
    MessageItem | ReasoningItem | FunctionCallItem | CustomToolCallItem | ToolSearchCallItem
)


class FunctionTool(msgspec.Struct, tag_field="type", tag="function", kw_only=True):
    """A flat function tool, as declared and as echoed."""

    name: str
    description: str | None = None
    parameters: dict[str, object] = {}
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, tag_field="type", tag="function", kw_only=True):
    """``tool_choice`` naming one function."""

    name: str


class ReasoningConfig(msgspec.Struct, kw_only=True):
    """The echoed ``reasoning`` request parameter."""

    effort: str | None = None
    summary: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The echoed ``text.format``: ``text``, ``json_object``, or ``json_schema`` with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, object] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    """The echoed ``text`` request parameter."""

    format: TextFormat = msgspec.field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] = "medium"


class InputTokensDetails(msgspec.Struct, kw_only=True):
    """Cached prompt tokens (a subset of ``input_tokens``)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    """Reasoning tokens (a subset of ``output_tokens``)."""

    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    """Token accounting of a finished response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct, kw_only=True):
    """Why a response failed (``code`` is one of the SDK's literals).

    ``retryable`` is sluice's addition (the event's flag): the SDK's model keeps unknown keys,
    so ``response.error.retryable`` reads it.
    """

    code: str
    message: str
    retryable: bool = False


class IncompleteDetails(msgspec.Struct, kw_only=True):
    """Why a response is incomplete."""

    reason: str


class Response(msgspec.Struct, kw_only=True):
    """The response object: the non-streaming body and the ``response`` of lifecycle events.

    Every field the official SDK's ``Response`` defines that a text model can fill is sent, in
    the order OpenAI sends them, with the request's value or the documented default.
    """

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    # The newest SDK's fields for features sluice does not have: null, as the API sends them
    # for a request that asked for none of them.
    access_programs: _Json | None = None
    background: bool = False
    completed_at: int | None = None  # when the terminal event was logged
    conversation: _Json | None = None
    error: ResponseError | None = None
    frequency_penalty: float = 0.0
    image: _Json | None = None
    incomplete_details: IncompleteDetails | None = None
    input_transformations: list[_Json] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    moderation: _Json | None = None
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    presence_penalty: float = 0.0
    previous_response_id: str | None = None
    prompt: _Json | None = None
    prompt_cache_diagnostics: _Json | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: _Json | None = None
    prompt_cache_retention: str | None = None
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    safety_identifier: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: str | _Json = "auto"  # echoed as sent
    tool_usage: _Json | None = None
    tools: list[_Json] = []  # echoed as sent, hosted tools included
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: Literal["disabled", "auto"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}


# Stream events. Each carries its wire ``type`` as the tag; ``sequence_number`` is last so the
# projector can stamp it when it emits the event.


class ResponseLifecycle(msgspec.Struct, kw_only=True):
    """``response.created`` / ``in_progress`` / ``completed`` / ``incomplete`` / ``failed``.

    Not a tagged Struct: the projector picks the type string, since all five share one shape.
    """

    type: str
    response: Response
    sequence_number: int


class OutputItemAdded(msgspec.Struct, tag_field="type", tag="response.output_item.added"):
    """A new output item opens (in progress, empty)."""

    output_index: int
    item: OutputItem
    sequence_number: int


class OutputItemDone(msgspec.Struct, tag_field="type", tag="response.output_item.done"):
    """An output item is final."""

    output_index: int
    item: OutputItem
    sequence_number: int


class ContentPartAdded(msgspec.Struct, tag_field="type", tag="response.content_part.added"):
    """A content part opens inside a message or reasoning item."""

    item_id: str
    output_index: int
    content_index: int
    part: Part
    sequence_number: int


class ContentPartDone(msgspec.Struct, tag_field="type", tag="response.content_part.done"):
    """A content part is final."""

    item_id: str
    output_index: int
    content_index: int
    part: Part
    sequence_number: int


class ErrorEvent(msgspec.Struct, tag_field="type", tag="error"):
    """An in-band error, followed by ``response.failed`` (``retryable``: as ``ResponseError``)."""

    code: str | None
    message: str
    param: str | None
    sequence_number: int
    retryable: bool = False


StreamEvent = (
    ResponseLifecycle
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | ReasoningSummaryPartAdded
    | ReasoningSummaryTextDelta
    | ReasoningSummaryTextDone
    | ReasoningSummaryPartDone
    | CustomToolCallInputDelta
    | CustomToolCallInputDone
    | ErrorEvent
)


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """What a projector needs besides events.

    Attributes:
        skeleton: the in-progress ``Response`` echoing the request (id, created_at, params).
        starting_after: replay only the events after this ``sequence_number`` (-1: all).
        signer: signs each finished reasoning item into its ``encrypted_content``.
    """

    skeleton: Response
    starting_after: int = -1
    signer: ReasoningSigner | None = None  # set when ``include`` asks for encrypted_content
