"""OpenAI Chat Completions request: the body's msgspec Structs and their translation to a job.

Owns only the inbound direction (JSON body -> ``GenerateRequest`` plus the few options the
projector needs). It does no I/O: model lookup, templating and enqueueing belong to
``services.api.submit``. Every rejection is an ``InvalidRequest`` naming the offending ``param``,
so clients get OpenAI's 400 ``invalid_request_error`` body, never FastAPI's 422.
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
from services.api.wire.constraints import (
    chat_constraint,
    check_tool_schemas,
)
from services.api.wire.extra_fields import REFUSED_EVERYWHERE, extra_fields, refuse
from services.api.wire.openai_chat.tools import ChatTool, parse_tool_choice, parse_tools
from services.api.wire.sampling import check_sampling, vllm_top_k
from shared.errors import InvalidRequest
from shared.jobs import (
    Constraint,
    GenerateRequest,
    Message,
    ReasoningControl,
    SamplingParams,
    TextPart,
    ToolCall,
)

__all__ = ["ChatOptions", "ChatRequest", "ParsedChat", "parse_request"]

_TEMPLATE_THINKING_KEYS = ("enable_thinking", "thinking")


class _Part(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None
    refusal: str | None = None


Content = str | list[_Part] | None


class _Function(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    arguments: str | JsonObject = ""


class _ToolCall(msgspec.Struct, forbid_unknown_fields=False):
    id: str
    function: _Function
    type: str = "function"


class _Message(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: Content = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool | None = None


class ChatRequest(msgspec.Struct, forbid_unknown_fields=False):
    """The Chat Completions body; unknown fields are accepted and ignored, as OpenAI's are."""

    model: str
    messages: list[_Message]
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    max_tokens: WireInt | None = None
    max_completion_tokens: WireInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: WireInt | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: WireInt | None = None
    logit_bias: dict[str, float] | None = None
    n: WireInt | None = None
    response_format: JsonObject | None = None
    structured_outputs: JsonObject | None = None  # vLLM's; and its older guided_* spellings
    guided_json: JsonObject | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool | None = None
    reasoning_format: str | None = None  # "inline" (llama.cpp's "none"): reasoning in content
    chat_template_kwargs: JsonObject | None = None
    ignore_eos: bool | None = None
    min_tokens: WireInt | None = None
    speculative: bool | None = None  # sluice's extension: false turns speculation off
    # vLLM's: the answer continues the final assistant message (a prefill) instead of a new turn;
    # add_generation_prompt false renders no assistant header after the last message
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None  # ["text"] is all sluice answers with
    # OpenAI's default is false, but sluice keeps every chat answer retrievable by id unless the
    # client says otherwise: only an explicit false makes the request unstored.
    store: bool | None = None


class ChatOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What the route and projector need beyond the job."""

    stream: bool = False
    include_usage: bool = False
    include_reasoning: bool = False


class ParsedChat(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request: the canonical job and the wire options."""

    job: GenerateRequest
    options: ChatOptions
    ignored_tools: list[str] = []  # custom tools' names: accepted, not offered to the model
    ignored_fields: list[str] = []  # undeclared top-level fields: accepted, not acted on


_DECODER = msgspec.json.Decoder(ChatRequest)
# Undeclared fields that would change the answer in a way sluice cannot honour; any other is
# accepted and named in x-sluice-ignored-fields (prompt-cache options, service_tier, ...).
_REFUSED = {
    **REFUSED_EVERYWHERE,
    "audio": "audio output is not supported: sluice answers with text only",
    "functions": "functions is not supported: declare them as tools",
    "function_call": "function_call is not supported: use tool_choice",
}


def parse_request(
    body: bytes, *, request_id: str, include_reasoning_header: bool = False
) -> ParsedChat:
    """Decode and validate a Chat Completions body into a job.

    Args:
        body: The raw request body.
        request_id: The id the job will carry.
        include_reasoning_header: True when the client sent ``X-Include-Reasoning: true``.

    Returns:
        The job (not yet rendered or tokenized) and the projector options.

    Raises:
        InvalidRequest: the body is not valid JSON, a field has the wrong type or value, or it
            asks for something sluice does not implement, or a structured-output schema,
            regex, choice list or grammar that does not compile. (``n`` is checked against
            ``SLUICE_MAX_N`` at admission.)
    """
    req = decode_body(_DECODER, body, _invalid)
    ignored_fields = refuse(extra_fields(body, ChatRequest), _REFUSED)
    _check_unsupported(req)
    inline = _inline(req.reasoning_format)
    include_reasoning = bool(req.include_reasoning) or include_reasoning_header or inline
    kwargs = dict(req.chat_template_kwargs or {})
    if req.add_generation_prompt is not None:
        kwargs.setdefault("add_generation_prompt", req.add_generation_prompt)
    tools, ignored = parse_tools(req.tools)
    tool_choice = parse_tool_choice(req.tool_choice, tools, ignored)
    check_tool_schemas(tools, tool_choice, lambda i: f"tools[{i}].function.parameters")
    job = GenerateRequest(
        request_id=request_id,
        model=req.model,
        origin="openai_chat",
        messages=_messages(req.messages),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        sampling=_sampling(req),
        max_tokens=_max_tokens(req),
        min_tokens=_non_negative(req.min_tokens, "min_tokens"),
        ignore_eos=bool(req.ignore_eos),
        speculative=req.speculative is not False,
        stop=_stop(req.stop),
        chat_template_kwargs=kwargs,
        reasoning=_reasoning(req.reasoning_effort, include_reasoning, kwargs, inline=inline),
        constraint=_constraint(req),
        user=req.user,
        metadata=dict(req.metadata or {}),
        store=req.store is not False,
        n=1 if req.n is None else req.n,
        continue_final=bool(req.continue_final_message),
    )
    options = ChatOptions(
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        include_reasoning=include_reasoning,
    )
    return ParsedChat(
        job=job, options=options, ignored_tools=ignored, ignored_fields=ignored_fields
    )


def _invalid(exc: msgspec.ValidationError) -> InvalidRequest:
    # OpenAI's message is msgspec's own, location included; the location is also the param.
    message = str(exc)
    return InvalidRequest(message, param=error_location(message)[1])


def _check_unsupported(req: ChatRequest) -> None:
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", param="logit_bias")
    if any(m != "text" for m in req.modalities or []):
        raise InvalidRequest("modalities: sluice answers with text only", param="modalities")
    if not req.messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    last = req.messages[-1]
    if req.continue_final_message and (last.role != "assistant" or last.tool_calls):
        raise InvalidRequest(
            "continue_final_message needs the last message to be the assistant's, with text "
            "and no tool_calls",
            param="continue_final_message",
        )


def _text(content: Content, param: str) -> list[TextPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextPart(text=content)] if content else []
    parts: list[TextPart] = []
    for j, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            parts.append(TextPart(text=part.text))
        elif part.type == "refusal" and part.refusal is not None:
            parts.append(TextPart(text=part.refusal))
        else:
            raise InvalidRequest(
                f"content part type {part.type!r} is not supported (text only)",
                param=f"{param}[{j}]",
            )
    return parts


def _messages(raw: list[_Message]) -> list[Message]:
    out: list[Message] = []
    call_names: dict[str, str] = {}  # tool results name their call's function for the template
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        content = _text(m.content, f"{param}.content")
        match m.role:
            case "system" | "developer":
                out.append(Message(role="system", content=content, name=m.name))
            case "user":
                out.append(Message(role="user", content=content, name=m.name))
            case "assistant":
                calls = [
                    _history_call(c, f"{param}.tool_calls[{k}]")
                    for k, c in enumerate(m.tool_calls or [])
                ]
                call_names.update((c.id, c.name) for c in calls)
                reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
                out.append(
                    Message(
                        role="assistant",
                        content=content,
                        tool_calls=calls,
                        reasoning=reasoning or None,
                        name=m.name,
                    )
                )
            case "tool" | "function":
                if m.role == "tool" and not m.tool_call_id:
                    raise InvalidRequest(
                        "a tool message needs tool_call_id", param=f"{param}.tool_call_id"
                    )
                name = m.name or call_names.get(m.tool_call_id or "")
                out.append(
                    Message(role="tool", content=content, tool_call_id=m.tool_call_id, name=name)
                )
            case _:
                raise InvalidRequest(f"unknown message role {m.role!r}", param=f"{param}.role")
    return out


def _history_call(call: _ToolCall, param: str) -> ToolCall:
    if call.type != "function":
        raise InvalidRequest(f"tool call type {call.type!r} is not supported", param=param)
    args = call.function.arguments
    text = args if isinstance(args, str) else msgspec.json.encode(args).decode()
    return ToolCall(id=call.id, name=call.function.name, arguments=text or "{}")


def _constraint(req: ChatRequest) -> Constraint | None:
    guided: dict[str, object] = {"json": req.guided_json, "regex": req.guided_regex}
    guided |= {"choice": req.guided_choice, "grammar": req.guided_grammar}
    return chat_constraint(req.response_format, req.structured_outputs, guided)


def _sampling(req: ChatRequest) -> SamplingParams:
    sampling = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=vllm_top_k(req.top_k),
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
    )
    return check_sampling(sampling)


def _max_tokens(req: ChatRequest) -> int | None:
    # max_completion_tokens is the current name; max_tokens is deprecated but still common.
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if value is not None and value < 1:
        raise InvalidRequest(f"{param} must be at least 1", param=param)
    return value


def _non_negative(value: int | None, param: str) -> int:
    if value is not None and value < 0:
        raise InvalidRequest(f"{param} must not be negative", param=param)
    return value or 0


def _stop(raw: str | list[str] | None) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    return [s for s in stops if s]


def _reasoning(
    effort: str | None, visible: bool, kwargs: JsonObject, *, inline: bool
) -> ReasoningControl:
    mapped = reasoning_effort(effort, "reasoning_effort")
    explicit = effort is not None or any(k in kwargs for k in _TEMPLATE_THINKING_KEYS)
    return ReasoningControl(effort=mapped, visible=visible, explicit=explicit, inline=inline)


# reasoning_format values: llama.cpp's server names the raw, inline form "none" and its parsed
# forms "deepseek", "deepseek-legacy" and "auto"; "parsed" is the plain word for the default.
_INLINE_FORMATS = {"inline", "none"}
_PARSED_FORMATS = {"parsed", "auto", "deepseek", "deepseek-legacy"}


def _inline(reasoning_format: str | None) -> bool:
    if reasoning_format is None or reasoning_format in _PARSED_FORMATS:
        return False
    if reasoning_format in _INLINE_FORMATS:
        return True
    known = ", ".join(sorted(_INLINE_FORMATS | _PARSED_FORMATS))
    raise InvalidRequest(f"reasoning_format must be one of {known}", param="reasoning_format")
