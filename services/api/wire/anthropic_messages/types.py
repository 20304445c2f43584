"""Anthropic Messages response Structs: the message, its content blocks and the stream events.

Owns the outbound wire shapes (those of the anthropic SDK's ``Message`` and
``RawMessageStreamEvent``) and the ``Context`` a request contributes to them; ``render`` and the
projector fill them from events. Every stream event is tagged by ``type``, which msgspec writes
first, and its ``event:`` name is the same tag. Field order is the order Anthropic sends, and
nothing is omitted: ``stop_reason: null`` in ``message_start`` is part of the wire format.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from services.api.wire.common import JsonObject
from services.api.wire.reasoning_tokens import ReasoningSigner

__all__ = [
    "BlockDelta",
    "ContentBlockDelta",
    "ContentBlockStart",
    "ContentBlockStop",
    "ContentOut",
    "Context",
    "ErrorDetail",
    "ErrorEvent",
    "InputJsonDeltaOut",
    "Message",
    "MessageDelta",
    "MessageStart",
    "MessageStop",
    "Ping",
    "SignatureDeltaOut",
    "StopDetails",
    "StopReason",
    "StreamEvent",
    "TextDeltaOut",
    "TextOut",
    "ThinkingDeltaOut",
    "ThinkingOut",
    "ToolUseOut",
    "UsageOut",
]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """What the projector and ``render`` need that is not in the events.

    Attributes:
        message_id: the ``id`` of the message (the request id, ``msg_…``).
        model: the model name the client asked for.
        show_thinking: False for ``thinking.display: "omitted"``: thinking blocks keep their
            place and signature but carry no text, as Anthropic's API does.
        signer: signs each thinking block's text into its ``signature`` (None: empty ones).
    """

    message_id: str
    model: str
    show_thinking: bool = True
    signer: ReasoningSigner | None = None


class UsageOut(msgspec.Struct, frozen=True):
    """Token accounting; ``input_tokens`` excludes cache reads (total input is the sum)."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


# -- content blocks -------------------------------------------------------------------------


class TextOut(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    """A text block."""

    text: str


class ThinkingOut(msgspec.Struct, frozen=True, tag_field="type", tag="thinking"):
    """A thinking block; clients echo it back with its signature on the next turn."""

    thinking: str
    signature: str


class ToolUseOut(msgspec.Struct, frozen=True, tag_field="type", tag="tool_use"):
    """A tool call; ``input`` is a JSON object (``{}`` when its block starts streaming)."""

    id: str
    name: str
    input: JsonObject


ContentOut = TextOut | ThinkingOut | ToolUseOut


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """The non-streaming response body, and the message ``message_start`` opens."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: UsageOut


# -- block deltas ---------------------------------------------------------------------------


class TextDeltaOut(msgspec.Struct, frozen=True, tag_field="type", tag="text_delta"):
    """More text of the open text block."""

    text: str


class ThinkingDeltaOut(msgspec.Struct, frozen=True, tag_field="type", tag="thinking_delta"):
    """More text of the open thinking block."""

    thinking: str


class SignatureDeltaOut(msgspec.Struct, frozen=True, tag_field="type", tag="signature_delta"):
    """A thinking block's signature, sent once right before the block stops."""

    signature: str


class InputJsonDeltaOut(msgspec.Struct, frozen=True, tag_field="type", tag="input_json_delta"):
    """A fragment of the open tool call's JSON input."""

    partial_json: str


BlockDelta = TextDeltaOut | ThinkingDeltaOut | SignatureDeltaOut | InputJsonDeltaOut


# -- stream events --------------------------------------------------------------------------


class MessageStart(msgspec.Struct, frozen=True, tag_field="type", tag="message_start"):
    """The first event: the message with no content yet and the prompt's usage."""

    message: Message


class ContentBlockStart(msgspec.Struct, frozen=True, tag_field="type", tag="content_block_start"):
    """A block opens at ``index`` (dense, one block open at a time)."""

    index: int
    content_block: ContentOut


class ContentBlockDelta(msgspec.Struct, frozen=True, tag_field="type", tag="content_block_delta"):
    """A delta of the open block; its type always matches the block's."""

    index: int
    delta: BlockDelta


class ContentBlockStop(msgspec.Struct, frozen=True, tag_field="type", tag="content_block_stop"):
    """The open block is complete."""

    index: int


class StopDetails(msgspec.Struct, frozen=True):
    """``message_delta.delta``: why the message stopped."""

    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, frozen=True, tag_field="type", tag="message_delta"):
    """The stop reason and the cumulative usage, right before ``message_stop``."""

    delta: StopDetails
    usage: UsageOut


class MessageStop(msgspec.Struct, frozen=True, tag_field="type", tag="message_stop"):
    """The last event of a finished message."""


class Ping(msgspec.Struct, frozen=True, tag_field="type", tag="ping"):
    """A keepalive; Anthropic clients expect ``ping`` events rather than SSE comments."""


class ErrorDetail(msgspec.Struct, frozen=True):
    """``error``: the error's type (e.g. ``overloaded_error``) and message."""

    type: str
    message: str


class ErrorEvent(msgspec.Struct, frozen=True, tag_field="type", tag="error"):
    """A failure after the headers were sent: the stream's last event."""

    error: ErrorDetail


StreamEvent = (
    MessageStart
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | Ping
    | ErrorEvent
)
