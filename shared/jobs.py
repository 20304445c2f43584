"""The canonical, format-agnostic request, and the tokenized job a worker runs.

Every wire format is parsed into a ``GenerateRequest``. The API renders its chat template and
tokenizes it (``shared.prompt``), and what it stores and enqueues is a ``Job``: the same request
plus the prompt token ids and text, both required, so a worker never renders a prompt and spends
its time on the model. ``Job`` is the arq payload (msgpack) and the ``job`` field of the request
hash; a ``Job`` is a ``GenerateRequest``, so whatever reads a request reads a job too.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "Constraint",
    "ContentPart",
    "GenerateRequest",
    "Job",
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
    "choice_id",
    "choice_seed",
]

Role = Literal["system", "user", "assistant", "tool"]
Origin = Literal[
    "openai_chat",
    "openai_responses",
    "anthropic_messages",
    "openai_completions",
    "native",
    "ollama",
]
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
    # A freeform (``custom``) tool's input format as the client sent it, e.g. ``{"type":
    # "grammar", "syntax": "lark", "definition": ...}``: the hook for constrained decoding of
    # the call's ``input`` argument. None for JSON-schema tools and unconstrained text.
    input_format: JsonObject | None = None
    strict: bool = False  # the arguments must validate against ``parameters`` (constrained)


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """Whether and which tool the model must call."""

    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None  # mode == "named"


ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """What the answer text must match, whichever wire parameter asked for it.

    Exactly one of the payload fields is set, the one ``kind`` names: ``json_schema`` (a JSON
    Schema), ``json_object`` (any JSON object; no payload), ``regex`` (the whole answer matches),
    ``choice`` (the answer is one of these strings) or ``grammar`` (a Lark grammar, llguidance's
    dialect). It is stored with the job, so a replayed or resumed request decodes under the same
    constraint. Forced tool calls are not a ``Constraint``: they follow from ``tools`` and
    ``tool_choice`` (and ``ToolDef.strict``) and the model's own tool-call syntax.
    """

    kind: ConstraintKind
    json_schema: JsonObject | None = None
    regex: str | None = None
    choices: list[str] = []
    grammar: str | None = None
    name: str | None = None  # the schema's name where the wire format has one


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
    # Chat's ``reasoning_format: "inline"``: the reasoning is shown inside the answer's content
    # between the model's own markers instead of in a field of its own (a projection choice,
    # kept on the job so a replay shows it the same way).
    inline: bool = False


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A generation request as the wire parsers produce it: nothing wire-specific, no prompt."""

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
    constraint: Constraint | None = None  # structured output (the answer after any reasoning)
    owner: str = ""  # hash of the API key that created the request ("" when auth is off)
    created: float = 0.0  # unix seconds, set by the API
    user: str | None = None
    metadata: dict[str, str] = {}
    # False (``store: false``): nothing is kept past the end but a short resume window
    # (``unstored_retention_s``), and the retrieve routes answer 404 as if it never existed.
    store: bool = True
    # True (legacy completions): the generated text is the answer exactly as written, reasoning
    # markers included. A raw prompt has no chat turns, so there is no reasoning block or tool
    # call to route apart; the worker decodes without its reasoning router and tool parser.
    raw_text: bool = False
    # False: this request never speculates (``SLUICE_SPECULATIVE`` on): its tokens are the same
    # either way, but a client may prefer one token per step's steady pacing to bursts.
    speculative: bool = True
    # How many choices the request asked for (Chat's and legacy Completions' ``n``). Each choice
    # is a job of its own, with its own stream, lease and failover (``choice_id``); the API
    # merges the streams into ``choices[i]``. ``choice``: which of them this job generates.
    n: int = 1
    choice: int = 0
    # Legacy Completions' prompt batch: the n choices are ``prompts`` runs of ``n // prompts``
    # choices, one run per prompt in order (OpenAI's ``index = prompt * n + j``); each choice's
    # job carries its own prompt. 1 everywhere else.
    prompts: int = 1
    # True: the last message is the start of the answer (an assistant prefill: Anthropic's final
    # assistant turn, vLLM's ``continue_final_message``); the prompt ends inside that message,
    # with no end-of-turn, and the answer's events carry only what follows it.
    continue_final: bool = False


def choice_id(rid: str, index: int) -> str:
    """The request id of choice ``index`` of request ``rid``.

    Choice 0 is the request itself, so a request without ``n`` is unchanged and every format
    that shows one answer replays choice 0 under the id the client got. The others are
    ``rid.1``, ``rid.2``, ...: derived, so any API replica finds them from the id alone, and
    ``.`` because ``:`` already marks a continuation's job id (``rid:2``).

    Args:
        rid: the request's id.
        index: the choice, from 0.

    Returns:
        The choice's request id.
    """
    return rid if index == 0 else f"{rid}.{index}"


def choice_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of choice ``index``: ``seed + index``, so each choice is reproducible
    and no two draw alike; wrapped within the 64 unsigned bits a seed may use.

    Args:
        seed: the request's seed, None for none (each choice then draws its own).
        index: the choice, from 0.

    Returns:
        The choice's seed.
    """
    if seed is None:
        return None
    return seed + index if seed + index < 2**64 else seed + index - 2**64


class Job(GenerateRequest, frozen=True, kw_only=True):
    """A request rendered and tokenized: what is stored, enqueued and generated."""

    prompt_token_ids: list[int]  # the rendered prompt tokenized (client text kept as text)
    prompt_text: str  # the rendered prompt, kept for debugging and replay

    @classmethod
    def of(cls, request: GenerateRequest, *, prompt_token_ids: list[int], prompt_text: str) -> Job:
        """The job for ``request`` with its rendered prompt.

        Args:
            request: the parsed request (a ``Job`` too: its prompt is replaced).
            prompt_token_ids: the prompt's token ids.
            prompt_text: the rendered prompt.

        Returns:
            The job.
        """
        fields = {f: getattr(request, f) for f in GenerateRequest.__struct_fields__}
        return cls(**fields, prompt_token_ids=prompt_token_ids, prompt_text=prompt_text)
