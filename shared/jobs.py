"""The canonical, format-agnostic generation job.

Every wire format is parsed into a ``GenerateRequest``; the API renders the chat template and
stores ``prompt_token_ids`` before enqueueing, so a worker spends its time on the model. A job
without prompt ids (e.g. from the native API) is rendered by the worker from ``messages``.
The same struct is the arq payload (msgpack) and the ``job`` field of the request hash.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "ContentPart",
    "GenerateRequest",
    "Message",
    "Origin",
    "ReasoningControl",
    "ReasoningEffort",
    "Role",
    "SamplingParams",
    "TextPart",
    "ToolCall",
    "ToolChoice",
    "ToolDef",
]

Role = Literal["system", "user", "assistant", "tool"]
Origin = Literal["openai_chat", "openai_responses", "anthropic_messages", "native"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
JsonObject = dict[str, object]


class TextPart(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    """A text content part."""

    text: str


ContentPart = TextPart  # a union once images/audio parts exist; the tag keeps it extensible


class ToolCall(msgspec.Struct, frozen=True):
    """A tool call replayed in conversation history (an earlier assistant turn)."""

    id: str
    name: str
    arguments: str  # JSON object as text, exactly as the model produced it


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One conversation turn."""

    role: Role
    content: list[ContentPart] = []
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None  # role == "tool": which call this result answers
    name: str | None = None  # tool name for role == "tool", or a participant name
    reasoning: str | None = None  # replayed reasoning of an earlier assistant turn
    is_error: bool = False  # a tool result that reports a failure

    @property
    def text(self) -> str:
        """The concatenated text of all parts."""
        return "".join(part.text for part in self.content)


class ToolDef(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: JsonObject = {}  # JSON Schema of the arguments object


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """Whether and which tool the model must call."""

    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None  # mode == "named"


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling knobs; ``None`` means the model's default (generation_config)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0


class ReasoningControl(msgspec.Struct, frozen=True, kw_only=True):
    """One typed reasoning control, mapped from every wire format.

    ``effort``/``budget_tokens`` say how much the model may think (``effort="none"`` disables
    thinking through the template where the model supports it); ``visible`` says whether the
    caller will see reasoning at all, so a server default can spare hidden thinking tokens.
    ``explicit`` is True when the client asked for something, which always beats the default.
    """

    effort: ReasoningEffort | None = None
    budget_tokens: int | None = None
    visible: bool = True
    explicit: bool = False


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A generation job: everything a worker needs, nothing wire-specific."""

    request_id: str
    model: str
    origin: Origin = "native"
    messages: list[Message] = []
    tools: list[ToolDef] = []
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    sampling: SamplingParams = SamplingParams()
    max_tokens: int | None = None  # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = []
    chat_template_kwargs: JsonObject = {}
    reasoning: ReasoningControl = ReasoningControl()
    prompt_token_ids: list[int] | None = None  # rendered + tokenized by the API
    prompt_text: str | None = None  # the rendered prompt, kept for debugging and replay
    owner: str = ""  # hash of the API key that created the request ("" when auth is off)
    created: float = 0.0  # unix seconds, set by the API
    user: str | None = None
    metadata: dict[str, str] = {}
