"""The OpenAI Responses object model: the response, its output items and its stream events.

Owns the msgspec Structs that are serialized onto the wire (and into the stored-response record)
for ``/v1/responses``. Field order follows what OpenAI sends so transcripts read naturally. Pure
data: no I/O, no parsing of client input (``request``), no projection logic (``projector``),
plus the ``Context`` a projector is built from.
"""

from __future__ import annotations

from typing import Literal

import msgspec

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

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class TopLogprob(msgspec.Struct, frozen=True):
    """One alternative token of an output_text logprob."""

    token: str
    bytes: list[int]
    logprob: float


class Logprob(msgspec.Struct, frozen=True):
    """Log-probability of one output token."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob] = []


class OutputText(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    """Answer text inside a message item."""

    annotations: list[dict[str, object]] = []
    logprobs: list[Logprob] = []
    text: str = ""


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text", kw_only=True):
    """Raw reasoning text inside a reasoning item (what open-weight servers stream)."""

    text: str = ""


class SummaryText(msgspec.Struct, tag_field="type", tag="summary_text", kw_only=True):
    """A reasoning summary part (only ever replayed by clients; sluice emits raw text)."""

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


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    """A function call output item: ``id`` is the item (``fc_``), ``call_id`` the call."""

    id: str
    status: ItemStatus
    arguments: str = ""
    call_id: str
    name: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


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
    """Why a response failed (``code`` is one of the SDK's literals)."""

    code: str
    message: str


class IncompleteDetails(msgspec.Struct, kw_only=True):
    """Why a response is incomplete."""

    reason: str


class Response(msgspec.Struct, kw_only=True):
    """The response object: the non-streaming body and the ``response`` of lifecycle events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    store: bool = True
    temperature: float | None = None
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    tools: list[FunctionTool] = []
    top_p: float | None = None
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


class OutputTextDelta(msgspec.Struct, tag_field="type", tag="response.output_text.delta"):
    """A fragment of answer text."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Logprob]
    sequence_number: int


class OutputTextDone(msgspec.Struct, tag_field="type", tag="response.output_text.done"):
    """The full text of an answer part."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Logprob]
    sequence_number: int


class ReasoningTextDelta(msgspec.Struct, tag_field="type", tag="response.reasoning_text.delta"):
    """A fragment of raw reasoning text."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    sequence_number: int


class ReasoningTextDone(msgspec.Struct, tag_field="type", tag="response.reasoning_text.done"):
    """The full raw reasoning text of a part."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    sequence_number: int


class FunctionCallArgumentsDelta(
    msgspec.Struct, tag_field="type", tag="response.function_call_arguments.delta"
):
    """A fragment of a call's JSON arguments."""

    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class FunctionCallArgumentsDone(
    msgspec.Struct, tag_field="type", tag="response.function_call_arguments.done"
):
    """A call's complete JSON arguments."""

    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int


class ErrorEvent(msgspec.Struct, tag_field="type", tag="error"):
    """An in-band error, followed by ``response.failed``."""

    code: str | None
    message: str
    param: str | None
    sequence_number: int


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
    | ErrorEvent
)


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """What a projector needs besides events.

    Attributes:
        skeleton: the in-progress ``Response`` echoing the request (id, created_at, params).
        starting_after: replay only the events after this ``sequence_number`` (-1: all).
    """

    skeleton: Response
    starting_after: int = -1
