"""Ollama ``/api/chat`` and ``/api/generate`` bodies, and their translation to a job.

Owns only the inbound direction and does no I/O. Unknown fields are accepted and ignored, as
Ollama's own server ignores them; what sluice cannot honour without changing the answer is a
400 naming the field: ``images`` (text-only models), and on generate ``raw``, ``template``,
``suffix`` and ``context`` (the prompt is always rendered with the model's own chat template).
``keep_alive`` is accepted and has no effect: a worker serves one model and keeps it loaded.
``stream`` defaults to true, as Ollama's does. A request without messages (chat) or prompt
(generate) is Ollama's way to load a model: ``load_only`` says to answer ``done_reason:
"load"`` without generating.
"""

from __future__ import annotations

import msgspec

from services.api.wire.common import (
    JsonObject,
    WireInt,
    decode_body,
    error_location,
    reasoning_effort,
)
from services.api.wire.constraints import check_tool_schemas
from services.api.wire.ollama.options import Options, max_tokens, num_ctx, sampling, stops
from shared.errors import InvalidRequest
from shared.grammar import check_constraint
from shared.jobs import (
    Constraint,
    GenerateRequest,
    Message,
    ReasoningControl,
    TextPart,
    ToolCall,
    ToolChoice,
    ToolDef,
)

__all__ = ["ChatBody", "GenerateBody", "Parsed", "parse_chat", "parse_generate"]

Think = bool | str | None
Format = str | JsonObject | None


class _Function(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    arguments: JsonObject | str = {}


class _ToolCall(msgspec.Struct, forbid_unknown_fields=False):
    function: _Function
    id: str | None = None


class _Message(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _FunctionDef(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    description: str | None = None
    parameters: JsonObject | None = None


class _Tool(msgspec.Struct, forbid_unknown_fields=False):
    type: str = "function"
    function: _FunctionDef | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str = ""
    stream: bool | None = None
    think: Think = None
    format: Format = None
    options: Options | None = None
    keep_alive: float | str | None = None
    logprobs: bool | None = None
    top_logprobs: WireInt | None = None


class ChatBody(_Common, kw_only=True):
    """The ``/api/chat`` body."""

    messages: list[_Message] | None = None
    tools: list[_Tool] | None = None


class GenerateBody(_Common, kw_only=True):
    """The ``/api/generate`` body."""

    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class Parsed(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request: the job and what the route needs beyond it."""

    job: GenerateRequest
    stream: bool = True
    num_ctx: int | None = None  # the client's context window, when it set one
    load_only: bool = False  # nothing to generate: answer done_reason "load"


_CHAT = msgspec.json.Decoder(ChatBody)
_GENERATE = msgspec.json.Decoder(GenerateBody)


def _invalid(exc: msgspec.ValidationError) -> InvalidRequest:
    message = str(exc)
    return InvalidRequest(message, param=error_location(message)[1])


def parse_chat(body: bytes, *, request_id: str) -> Parsed:
    """Decode and validate an ``/api/chat`` body into a job.

    Raises:
        InvalidRequest: not JSON, a wrong shape or value, or something sluice cannot honour.
    """
    req = decode_body(_CHAT, body, _invalid)
    _require_model(req)
    tools = _tools(req.tools)
    check_tool_schemas(tools, ToolChoice(), lambda i: f"tools[{i}].function.parameters")
    messages = _messages(req.messages or [])
    job = _job(req, request_id, messages)
    # Ollama's templates leave a final assistant message open (no end-of-turn, no new turn):
    # the model writes on inside it, a prefill as Anthropic's
    last = messages[-1] if messages else Message(role="user")
    prefill = last.role == "assistant" and not last.tool_calls and bool(last.text.strip())
    job = msgspec.structs.replace(
        job,
        tools=tools,
        tool_choice=ToolChoice(mode="auto" if tools else "none"),
        continue_final=prefill,
    )
    return Parsed(
        job=job,
        stream=req.stream is not False,
        num_ctx=num_ctx(req.options),
        load_only=not messages,
    )


def parse_generate(body: bytes, *, request_id: str) -> Parsed:
    """Decode and validate an ``/api/generate`` body into a job (system and prompt as messages).

    Raises:
        InvalidRequest: not JSON, a wrong shape or value, or something sluice cannot honour.
    """
    req = decode_body(_GENERATE, body, _invalid)
    _require_model(req)
    if req.raw:
        raise InvalidRequest(
            "raw prompts are not supported: sluice always applies the model's chat template",
            param="raw",
        )
    for name, value in (("template", req.template), ("suffix", req.suffix)):
        if value:
            raise InvalidRequest(f"{name} is not supported on /api/generate", param=name)
    if req.context:
        raise InvalidRequest(
            "context is not supported: send the conversation to /api/chat", param="context"
        )
    _no_images(req.images, "images")
    messages: list[Message] = []
    if req.system:
        messages.append(Message(role="system", content=[TextPart(text=req.system)]))
    if req.prompt:
        messages.append(Message(role="user", content=[TextPart(text=req.prompt)]))
    return Parsed(
        job=_job(req, request_id, messages),
        stream=req.stream is not False,
        num_ctx=num_ctx(req.options),
        load_only=not req.prompt,
    )


def _require_model(req: _Common) -> None:
    if not req.model:
        raise InvalidRequest("model is required", param="model")


def _job(req: _Common, request_id: str, messages: list[Message]) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        model=req.model,
        origin="ollama",
        messages=messages,
        sampling=sampling(req.options, logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs),
        max_tokens=max_tokens(req.options),
        stop=stops(req.options),
        reasoning=_reasoning(req.think),
        constraint=_format(req.format),
    )


def _reasoning(think: Think) -> ReasoningControl:
    """``think``: true or false, or an effort (``low``/``medium``/``high``, gpt-oss's levels)."""
    if think is None:
        return ReasoningControl()
    if think is False:
        return ReasoningControl(effort="none", visible=False, explicit=True)
    if think is True:
        return ReasoningControl(explicit=True)
    effort = reasoning_effort(think, "think")
    return ReasoningControl(effort=effort, explicit=True)


def _format(raw: Format) -> Constraint | None:
    """``format``: ``"json"`` (any JSON object) or a JSON schema object; ``""`` is none."""
    if raw is None or raw == "":
        return None
    if raw == "json":
        constraint = Constraint(kind="json_object")
    elif isinstance(raw, dict):
        constraint = Constraint(kind="json_schema", json_schema=raw)
    else:
        raise InvalidRequest(
            f'invalid format {raw!r}: use "json" or a JSON schema object', param="format"
        )
    check_constraint(constraint, "format")
    return constraint


def _no_images(images: list[str] | None, param: str) -> None:
    if images:
        raise InvalidRequest(
            "images are not supported: sluice serves text-only models", param=param
        )


def _tools(raw: list[_Tool] | None) -> list[ToolDef]:
    out: list[ToolDef] = []
    for i, tool in enumerate(raw or []):
        if tool.type != "function" or tool.function is None:
            raise InvalidRequest(
                f"tool type {tool.type!r} is not supported (function tools only)",
                param=f"tools[{i}]",
            )
        fn = tool.function
        out.append(
            ToolDef(name=fn.name, description=fn.description, parameters=fn.parameters or {})
        )
    return out


def _messages(raw: list[_Message]) -> list[Message]:
    out: list[Message] = []
    # Ollama's history calls usually carry no id, and its tool results name the tool, not the
    # call: ids are made up per call and each result answers the oldest open call of its name.
    open_calls: list[ToolCall] = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        _no_images(m.images, f"{param}.images")
        content = [TextPart(text=m.content)] if m.content else []
        match m.role:
            case "system" | "user":
                out.append(Message(role=m.role, content=content))
            case "assistant":
                calls = [_history_call(c, i, k) for k, c in enumerate(m.tool_calls or [])]
                open_calls.extend(calls)
                out.append(
                    Message(
                        role="assistant",
                        content=content,
                        tool_calls=calls,
                        reasoning=m.thinking or None,
                    )
                )
            case "tool":
                call = _answered(open_calls, m.tool_call_id, m.tool_name)
                name = m.tool_name or (call.name if call else None)
                call_id = m.tool_call_id or (call.id if call else None)
                out.append(Message(role="tool", content=content, tool_call_id=call_id, name=name))
            case _:
                raise InvalidRequest(f"unknown message role {m.role!r}", param=f"{param}.role")
    return out


def _history_call(call: _ToolCall, i: int, k: int) -> ToolCall:
    args = call.function.arguments
    text = args if isinstance(args, str) else msgspec.json.encode(args).decode()
    return ToolCall(id=call.id or f"call_{i}_{k}", name=call.function.name, arguments=text or "{}")


def _answered(open_calls: list[ToolCall], call_id: str | None, name: str | None) -> ToolCall | None:
    for j, call in enumerate(open_calls):
        if (call_id and call.id == call_id) or (
            not call_id and (name is None or call.name == name)
        ):
            return open_calls.pop(j)
    return None
