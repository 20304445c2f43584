"""Anthropic Messages request-body Structs: content blocks, tools, thinking and the body.

Owns the inbound wire shapes only (those of the anthropic SDK's ``MessageCreateParams``);
``request`` decodes bodies into them, validates them and translates them into the canonical job.
Unknown fields are accepted and ignored, as Anthropic's API does.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from services.api.wire.common import JsonObject

__all__ = [
    "BLOCK_TYPES",
    "ContentBlock",
    "InputMessage",
    "MessagesRequest",
    "Metadata",
    "OutputConfig",
    "RedactedThinkingBlock",
    "TextBlock",
    "ThinkingBlock",
    "ThinkingParam",
    "Tool",
    "ToolChoiceParam",
    "ToolResultBlock",
    "ToolUseBlock",
]


# -- content blocks -------------------------------------------------------------------------


class TextBlock(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    """``{"type": "text", "text": ...}``; ``cache_control`` / ``citations`` are ignored."""

    text: str


class ToolUseBlock(msgspec.Struct, frozen=True, tag_field="type", tag="tool_use"):
    """A tool call of an earlier assistant turn; ``input`` is a JSON object."""

    id: str
    name: str
    input: JsonObject = {}


class ToolResultBlock(msgspec.Struct, frozen=True, tag_field="type", tag="tool_result"):
    """The result of a tool call, sent in the next user turn."""

    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, frozen=True, tag_field="type", tag="thinking"):
    """Replayed reasoning; local models have no real signature, so any (or none) is fine."""

    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, frozen=True, tag_field="type", tag="redacted_thinking"):
    """Opaque encrypted reasoning from another provider: accepted and dropped."""

    data: str = ""


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
BLOCK_TYPES = "text, tool_use, tool_result, thinking, redacted_thinking"
# The largest count a request may carry (``wire.common.WireInt``): larger is a 400, not a 500.
_MAX = 2**63 - 1


class InputMessage(msgspec.Struct, frozen=True):
    """One turn of ``messages``."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock] = ""


# -- tools, tool_choice, thinking, metadata -------------------------------------------------


class Tool(msgspec.Struct, frozen=True):
    """A client tool; server tools carry a versioned ``type`` and are not supported."""

    name: str
    input_schema: JsonObject = {}
    description: str | None = None
    type: str | None = None
    strict: bool | None = None  # the input must validate against input_schema (constrained)


class ToolChoiceParam(msgspec.Struct, frozen=True):
    """``{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type == "tool"
    disable_parallel_tool_use: bool = False


class ThinkingParam(msgspec.Struct, frozen=True):
    """How much to think: ``enabled`` (with a budget), ``disabled``, ``adaptive`` or
    ``between_tools`` (thinking off; Anthropic's models may still write short progress notes
    between tool calls, which a local model does not, so it is ``disabled`` here).

    ``budget_tokens`` counts toward ``max_tokens``; ``display: "omitted"`` hides the text.
    ``"updates"`` (Claude Code 2.1.332 sends it) asks for progress updates instead of the
    thinking; sluice has no such summariser, so it shows the thinking as ``"summarized"`` does
    and names ``thinking.display`` in ``x-sluice-ignored-fields``.
    """

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Meta(ge=1, le=_MAX)] | None = None
    display: Literal["summarized", "omitted", "updates"] | None = None


class OutputConfig(msgspec.Struct, frozen=True):
    """SDK 2.x ``output_config``: ``effort`` and ``format`` (a JSON schema the answer follows)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonObject | None = None


class Metadata(msgspec.Struct, frozen=True):
    """``metadata.user_id``; ``script`` selects a scripted-backend scenario in tests."""

    user_id: str | None = None
    script: str | None = None


class MessagesRequest(msgspec.Struct, frozen=True):
    """The body of ``POST /v1/messages``; unknown top-level fields are accepted and ignored."""

    model: str
    messages: list[InputMessage]
    max_tokens: Annotated[int, Meta(ge=1, le=_MAX)] | None = None
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=_MAX)] | None = None  # 0 means "no top-k"
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    output_format: JsonObject | None = None  # the beta spelling of output_config.format
    metadata: Metadata | None = None
    stream: bool = False
