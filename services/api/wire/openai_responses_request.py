"""Parse a ``POST /v1/responses`` body into the canonical job, and rebuild conversations.

Owns the request Structs, validation (every failure is ``InvalidRequest`` with the offending
``param``, never FastAPI's 422), the mapping of Responses input items onto ``Message`` turns
(also used to replay a stored response's output for ``previous_response_id``), and the echo of
request parameters into the ``Response`` skeleton. No I/O: the route loads stored history and
passes it in.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal, cast

import msgspec

from services.api.wire.openai_responses_types import (
    FunctionTool,
    ReasoningConfig,
    Response,
    ToolChoiceFunction,
)
from shared.errors import InvalidRequest
from shared.jobs import (
    GenerateRequest,
    Message,
    ReasoningControl,
    ReasoningEffort,
    SamplingParams,
    TextPart,
    ToolCall,
    ToolChoice,
    ToolDef,
)

__all__ = [
    "ResponsesRequest",
    "build_job",
    "input_messages",
    "items_to_messages",
    "parse_request",
    "skeleton",
]

JsonObject = dict[str, object]
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Efforts newer SDKs know that the job's vocabulary lacks map onto its strongest level.
_EFFORTS: dict[str, ReasoningEffort] = {
    "none": "none",
    "minimal": "minimal",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


class _Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # deprecated alias of summary


class _TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"


class _Text(msgspec.Struct, kw_only=True):
    format: _TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The request body; unknown fields are accepted and ignored, as OpenAI clients expect."""

    model: str
    input: str | list[JsonObject] = []
    instructions: str | None = None
    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    reasoning: _Reasoning | None = None
    text: _Text | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = None
    background: bool | None = None
    conversation: str | JsonObject | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None


class _Part(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None


class _MessageIn(msgspec.Struct, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]


class _FunctionCallIn(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutputIn(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[_Part]


class _ReasoningIn(msgspec.Struct, kw_only=True):
    summary: list[_Part] = []
    content: list[_Part] | None = None
    encrypted_content: str | None = None  # opaque, possibly from another server: ignored


_AT = re.compile(r" - at `\$\.?(.*)`$")


def _invalid(exc: msgspec.ValidationError, prefix: str = "") -> InvalidRequest:
    """Turn msgspec's ``... - at `$.a[0].b``` message into a message plus ``param``."""
    text = str(exc)
    match = _AT.search(text)
    path = match.group(1) if match else ""
    param = f"{prefix}{'.' if prefix and path and not path.startswith('[') else ''}{path}"
    message = _AT.sub("", text)
    return InvalidRequest(f"{message} (at '{param}')" if param else message, param=param or None)


def parse_request(body: bytes) -> ResponsesRequest:
    """Decode and validate a request body.

    Args:
        body: the raw HTTP body.

    Returns:
        The request, with every cross-field rule checked.

    Raises:
        InvalidRequest: malformed JSON, a wrong type, or an unsupported option.
    """
    try:
        req = msgspec.json.decode(body, type=ResponsesRequest)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc
    _check_ranges(req)
    if req.conversation is not None:
        raise InvalidRequest(
            "'conversation' is not supported; chain turns with 'previous_response_id'",
            param="conversation",
        )
    if req.background:
        raise InvalidRequest("Background mode is not supported", param="background")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        raise InvalidRequest(
            f"text.format type '{fmt.type}' is not supported: this server does not implement "
            "structured output (constrained decoding); use type 'text'",
            param="text.format",
        )
    if not req.input and req.previous_response_id is None and not req.instructions:
        raise InvalidRequest("'input' is required", param="input")
    return req


def _check_ranges(req: ResponsesRequest) -> None:
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidRequest("max_output_tokens must be at least 1", param="max_output_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise InvalidRequest("top_p must be greater than 0 and at most 1", param="top_p")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None and effort not in _EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort must be one of {', '.join(_EFFORTS)}", param="reasoning.effort"
        )


def _parse_tools(req: ResponsesRequest) -> list[FunctionTool]:
    tools: list[FunctionTool] = []
    for i, raw in enumerate(req.tools or []):
        kind = raw.get("type")
        if kind != "function":
            raise InvalidRequest(
                f"Unsupported tool type {kind!r}: only function tools are supported",
                param=f"tools[{i}].type",
            )
        try:
            tools.append(msgspec.convert(raw, FunctionTool))
        except msgspec.ValidationError as exc:
            raise _invalid(exc, f"tools[{i}]") from exc
    return tools


def _parse_tool_choice(
    req: ResponsesRequest, tools: list[FunctionTool]
) -> tuple[Literal["none", "auto", "required"] | ToolChoiceFunction, list[FunctionTool]]:
    """Return the echoed choice and the tools the model may see (``allowed_tools`` narrows)."""
    raw = req.tool_choice
    names = {t.name for t in tools}
    if raw is None:
        return "auto", tools
    if raw in ("none", "auto", "required"):
        return cast(Literal["none", "auto", "required"], raw), tools
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name")
        if not isinstance(name, str) or name not in names:
            raise InvalidRequest(
                f"tool_choice names function {name!r}, which is not in 'tools'",
                param="tool_choice.name",
            )
        return ToolChoiceFunction(name=name), tools
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        mode, allowed = raw.get("mode", "auto"), raw.get("tools", [])
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise InvalidRequest("Invalid allowed_tools tool_choice", param="tool_choice")
        keep = {t.get("name") for t in allowed if isinstance(t, dict)}
        return mode, [t for t in tools if t.name in keep]
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required', or a function", param="tool_choice"
    )


def skeleton(req: ResponsesRequest, response_id: str, created_at: int) -> Response:
    """The in-progress ``Response`` echoing the request's parameters (``output: []``).

    Args:
        req: the parsed request.
        response_id: the response id (``resp_...``), also the request id.
        created_at: unix seconds.

    Returns:
        The skeleton that ``response.created`` carries and every later state extends.

    Raises:
        InvalidRequest: an unsupported tool or an invalid ``tool_choice``.
    """
    tools = _parse_tools(req)
    choice, _ = _parse_tool_choice(req, tools)
    effort = req.reasoning.effort if req.reasoning else None
    summary = (req.reasoning.summary or req.reasoning.generate_summary) if req.reasoning else None
    return Response(
        id=response_id,
        created_at=created_at,
        status="in_progress",
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=req.model,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        reasoning=ReasoningConfig(effort=effort, summary=summary),
        store=req.store is not False,
        temperature=req.temperature,
        tool_choice=choice,
        tools=tools,
        top_p=req.top_p,
        truncation=req.truncation or "disabled",
        user=req.user,
        metadata=req.metadata or {},
    )


def _part_text(part: _Part, where: str) -> str:
    if part.type in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        return part.text or ""
    if part.type == "refusal":
        return part.refusal or ""
    raise InvalidRequest(
        f"Content part type {part.type!r} is not supported: this server serves text-only models",
        param=where,
    )


def _content_text(content: str | list[_Part], where: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(_part_text(p, f"{where}[{j}]") for j, p in enumerate(content))


class _Conversation:
    """Folds items into turns: one assistant message per turn gathers reasoning, text, calls."""

    def __init__(self, prior: Sequence[Message]) -> None:
        self.messages: list[Message] = list(prior)
        self.call_names = {c.id: c.name for m in prior for c in m.tool_calls}
        self._text: list[str] = []
        self._calls: list[ToolCall] = []
        self._reasoning: list[str] = []

    def reasoning(self, text: str) -> None:
        if self._text or self._calls:
            self.flush()
        if text:
            self._reasoning.append(text)

    def assistant_text(self, text: str) -> None:
        if self._calls:
            self.flush()
        self._text.append(text)

    def call(self, call: ToolCall) -> None:
        self.call_names[call.id] = call.name
        self._calls.append(call)

    def append(self, message: Message) -> None:
        self.flush()
        self.messages.append(message)

    def flush(self) -> None:
        # Reasoning with no answer after it (a cut-off turn) renders as nothing: drop it.
        if self._text or self._calls:
            text = "".join(self._text)
            self.messages.append(
                Message(
                    role="assistant",
                    content=[TextPart(text=text)] if text else [],
                    tool_calls=self._calls,
                    reasoning="".join(self._reasoning) or None,
                )
            )
        self._text, self._calls, self._reasoning = [], [], []


def items_to_messages(
    items: Sequence[JsonObject], prior: Sequence[Message] = (), *, param: str = "input"
) -> list[Message]:
    """Map Responses items (input items, or a stored response's output) onto turns.

    Args:
        items: message, function_call, function_call_output and reasoning items.
        prior: turns that come before these items (their tool calls name later outputs).
        param: the request field the items came from, for error messages.

    Returns:
        ``prior`` followed by the items' turns.

    Raises:
        InvalidRequest: an unknown item type or a malformed item.
    """
    conv = _Conversation(prior)
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        try:
            _add_item(conv, kind, item, where)
        except msgspec.ValidationError as exc:
            raise _invalid(exc, where) from exc
    conv.flush()
    return conv.messages


def _add_item(conv: _Conversation, kind: object, item: JsonObject, where: str) -> None:
    if kind == "message":
        msg = msgspec.convert(item, _MessageIn)
        text = _content_text(msg.content, f"{where}.content")
        if msg.role == "assistant":
            conv.assistant_text(text)
        else:
            role: Literal["user", "system"] = "user" if msg.role == "user" else "system"
            conv.append(Message(role=role, content=[TextPart(text=text)]))
    elif kind == "function_call":
        fc = msgspec.convert(item, _FunctionCallIn)
        conv.call(ToolCall(id=fc.call_id, name=fc.name, arguments=fc.arguments))
    elif kind == "function_call_output":
        out = msgspec.convert(item, _FunctionCallOutputIn)
        text = _content_text(out.output, f"{where}.output")
        name = conv.call_names.get(out.call_id)
        conv.append(
            Message(role="tool", content=[TextPart(text=text)], tool_call_id=out.call_id, name=name)
        )
    elif kind == "reasoning":
        rs = msgspec.convert(item, _ReasoningIn)
        # Raw reasoning text is what the model wrote; a summary is the next best thing. An
        # encrypted blob we cannot read (another server's) is ignored, never an error.
        parts = rs.content if rs.content else rs.summary
        conv.reasoning("".join(_part_text(p, f"{where}.content") for p in parts))
    else:
        raise InvalidRequest(
            f"Input item type {kind!r} is not supported; use message, function_call, "
            "function_call_output or reasoning items",
            param=f"{where}.type",
        )


def input_messages(req: ResponsesRequest, history: Sequence[Message] = ()) -> list[Message]:
    """The conversation of this request without ``instructions``: history, then ``input``.

    Args:
        req: the parsed request.
        history: turns rebuilt from ``previous_response_id`` (empty without one).

    Returns:
        The turns to store for the next ``previous_response_id`` and to send to the model.

    Raises:
        InvalidRequest: a malformed input item.
    """
    if isinstance(req.input, str):
        return [*history, Message(role="user", content=[TextPart(text=req.input)])]
    return items_to_messages(req.input, history)


def build_job(
    req: ResponsesRequest,
    *,
    request_id: str,
    conversation: Sequence[Message],
    owner: str,
    created: float,
) -> GenerateRequest:
    """Build the canonical job.

    Args:
        req: the parsed request.
        request_id: the response id, which is also the request id.
        conversation: ``input_messages(req, history)``.
        owner: the authenticated owner id.
        created: unix seconds.

    Returns:
        The job, ``instructions`` first as a system message (they never carry over).

    Raises:
        InvalidRequest: an unsupported tool or an invalid ``tool_choice``.
    """
    tools = _parse_tools(req)
    choice, visible_tools = _parse_tool_choice(req, tools)
    if isinstance(choice, ToolChoiceFunction):
        tool_choice = ToolChoice(mode="named", name=choice.name)
    else:
        tool_choice = ToolChoice(mode=choice)
    system = [Message(role="system", content=[TextPart(text=req.instructions or "")])]
    effort = req.reasoning.effort if req.reasoning else None
    logprobs = _LOGPROBS_INCLUDE in (req.include or [])
    return GenerateRequest(
        request_id=request_id,
        model=req.model,
        origin="openai_responses",
        messages=[*(system if req.instructions else []), *conversation],
        tools=[
            ToolDef(name=t.name, description=t.description, parameters=t.parameters)
            for t in visible_tools
        ],
        tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        sampling=SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            logprobs=logprobs,
            top_logprobs=(req.top_logprobs or 0) if logprobs else 0,
        ),
        max_tokens=req.max_output_tokens,
        reasoning=ReasoningControl(
            effort=_EFFORTS[effort] if effort else None, visible=True, explicit=effort is not None
        ),
        owner=owner,
        created=created,
        user=req.user,
        metadata=req.metadata or {},
    )
