"""Parse a ``POST /v1/responses`` body into the canonical job and the response skeleton.

Owns the request Struct, validation (every failure is ``InvalidRequest`` with the offending
``param``, never FastAPI's 422), the mapping of parameters onto ``GenerateRequest`` (tools,
tool_choice, sampling, reasoning, limits, ``text.format``) and their echo into the ``Response``
skeleton. Input items become turns in ``items``. No I/O: the route loads stored history (for
``previous_response_id``) and passes it in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

import msgspec

from services.api.wire.common import (
    EFFORTS,
    UNDECODABLE,
    JsonObject,
    WireInt,
    check_range,
    reasoning_effort,
    undecodable,
)
from services.api.wire.constraints import check_tool_schemas, openai_format
from services.api.wire.extra_fields import REFUSED_EVERYWHERE, extra_fields, refuse
from services.api.wire.openai_responses.items import items_to_messages, validation_error
from services.api.wire.openai_responses.tools import (
    HOSTED_TOOL_TYPES,
    ToolSet,
    echoed,
    exposed_name,
    parse_tools,
)
from services.api.wire.openai_responses.types import (
    ReasoningConfig,
    Response,
    TextConfig,
    TextFormat,
)
from services.api.wire.reasoning_tokens import ReasoningSigner
from services.api.wire.sampling import LIMITS, check_sampling
from shared.errors import InvalidRequest
from shared.jobs import (
    Constraint,
    GenerateRequest,
    Message,
    ReasoningControl,
    SamplingParams,
    TextPart,
    ToolChoice,
    ToolDef,
)

__all__ = [
    "ResponsesRequest",
    "build_job",
    "input_messages",
    "parse_request",
    "skeleton",
    "tool_set",
]

_LOGPROBS_INCLUDE = "message.output_text.logprobs"
# A stored prompt template sluice cannot resolve would answer a different question.
_REFUSED = {**REFUSED_EVERYWHERE, "prompt": "'prompt' (a stored prompt) is not supported"}


class _Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # deprecated alias of summary


class _Text(msgspec.Struct, kw_only=True):
    format: JsonObject | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The request body; unknown fields are accepted and ignored, as OpenAI clients expect."""

    model: str
    input: str | list[JsonObject] = []
    instructions: str | None = None
    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: WireInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: WireInt | None = None
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
    # Echoed in the response (sluice has one service tier and no prompt-cache options).
    max_tool_calls: WireInt | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None


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
        raise validation_error(exc) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc
    except UNDECODABLE as exc:
        raise undecodable(exc) from exc
    refuse(extra_fields(body, ResponsesRequest), _REFUSED)
    _check_ranges(req)
    if req.conversation is not None:
        raise InvalidRequest(
            "'conversation' is not supported; chain turns with 'previous_response_id'",
            param="conversation",
        )
    if req.background and req.store is False:
        raise InvalidRequest("Background responses must be stored (store: true)", param="store")
    if req.background and req.stream:
        # A streaming client that disconnects cancels its generation, which background
        # responses must survive; poll GET (or GET ?stream=true) instead.
        raise InvalidRequest(
            "stream with background is not supported; create it, then GET "
            "/v1/responses/{id}?stream=true",
            param="stream",
        )
    _constraint(req)  # a schema that cannot compile is rejected before anything is stored
    if not req.input and req.previous_response_id is None and not req.instructions:
        raise InvalidRequest("'input' is required", param="input")
    return req


def _constraint(req: ResponsesRequest) -> Constraint | None:
    return openai_format(req.text.format if req.text else None, "text.format", nested=False)


def _text_config(req: ResponsesRequest) -> TextConfig:
    """The echoed ``text``: the structured-output format when one applies, and the verbosity."""
    verbosity = (req.text.verbosity if req.text else None) or "medium"
    fmt = req.text.format if req.text is not None else None
    if fmt is None or _constraint(req) is None:
        return TextConfig(verbosity=verbosity)
    return TextConfig(format=msgspec.convert(fmt, TextFormat), verbosity=verbosity)


def _check_ranges(req: ResponsesRequest) -> None:
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidRequest("max_output_tokens must be at least 1", param="max_output_tokens")
    # Checked as the parse's first step, so the skeleton never holds an unusable value; without
    # logprobs, top_logprobs is dropped from the job, but it must still be in range.
    check_sampling(SamplingParams(temperature=req.temperature, top_p=req.top_p))
    check_range(req.top_logprobs, *LIMITS.top_logprobs, "top_logprobs")
    metadata = req.metadata or {}
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise InvalidRequest(
            "metadata allows at most 16 pairs, keys up to 64 and values up to 512 characters",
            param="metadata",
        )
    reasoning_effort(
        req.reasoning.effort if req.reasoning is not None else None, "reasoning.effort"
    )


def tool_set(req: ResponsesRequest) -> ToolSet:
    """The request's tools, plus those a client ``tool_search`` loaded earlier in ``input``.

    Args:
        req: the parsed request.

    Returns:
        What the model sees, how its calls map back, and the hosted tools left out.

    Raises:
        InvalidRequest: a malformed or unknown tool.
    """
    declared = list(req.tools or [])
    # Tools a client-executed search returned are callable from then on, as on OpenAI.
    if isinstance(req.input, list):
        for item in req.input:
            loaded = item.get("tools") if item.get("type") == "tool_search_output" else None
            if isinstance(loaded, list):
                declared.extend(t for t in loaded if isinstance(t, dict))
    return parse_tools(declared)


def _allowed_name(tool: JsonObject) -> str:
    """The model-visible name of one ``allowed_tools`` entry."""
    if tool.get("type") == "tool_search":
        return "tool_search"
    namespace = tool.get("namespace")
    return exposed_name(str(tool.get("name")), namespace if isinstance(namespace, str) else None)


def _parse_tool_choice(req: ResponsesRequest, tools: ToolSet) -> tuple[ToolChoice, list[ToolDef]]:
    """Return the job's choice and the tools the model may see (``allowed_tools`` narrows)."""
    raw = req.tool_choice
    if raw is None:
        return ToolChoice(mode="auto"), tools.defs
    if raw in ("none", "auto", "required"):
        return ToolChoice(mode=cast(Literal["none", "auto", "required"], raw)), tools.defs
    if not isinstance(raw, dict):
        raise InvalidRequest(f"tool_choice {raw!r} is not supported", param="tool_choice")
    kind = raw.get("type")
    if kind in ("function", "custom"):
        name = raw.get("name")
        namespace = raw.get("namespace")
        exposed = exposed_name(str(name), namespace if isinstance(namespace, str) else None)
        route = tools.routes.get(exposed)
        if not isinstance(name, str) or route is None or route.kind != kind:
            raise InvalidRequest(
                f"tool_choice names {kind} tool {name!r}, which is not in 'tools'",
                param="tool_choice.name",
            )
        return ToolChoice(mode="named", name=exposed), tools.defs
    if kind == "allowed_tools":
        mode, allowed = raw.get("mode", "auto"), raw.get("tools", [])
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise InvalidRequest("Invalid allowed_tools tool_choice", param="tool_choice")
        keep = {_allowed_name(t) for t in allowed if isinstance(t, dict)}
        return ToolChoice(mode=mode), [t for t in tools.defs if t.name in keep]
    if kind == "tool_search" and "tool_search" in tools.routes:
        return ToolChoice(mode="named", name="tool_search"), tools.defs
    if isinstance(kind, str) and (kind in HOSTED_TOOL_TYPES or kind == "tool_search"):
        # A forced hosted tool cannot be honoured by skipping it: the caller must know.
        raise InvalidRequest(
            f"tool_choice forces the hosted tool {kind!r}, which this server cannot run",
            param="tool_choice.type",
        )
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required', a function, a custom tool or "
        "allowed_tools",
        param="tool_choice",
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
    _parse_tool_choice(req, tool_set(req))  # every check passes before anything is stored
    effort = req.reasoning.effort if req.reasoning else None
    summary = (req.reasoning.summary or req.reasoning.generate_summary) if req.reasoning else None
    return Response(
        id=response_id,
        created_at=created_at,
        status="in_progress",
        background=bool(req.background),
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=req.model,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        reasoning=ReasoningConfig(effort=effort, summary=summary),
        store=req.store is not False,
        temperature=1.0 if req.temperature is None else req.temperature,
        text=_text_config(req),
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        tools=echoed(req.tools or []),
        top_logprobs=req.top_logprobs or 0,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tool_calls=req.max_tool_calls,
        prompt_cache_key=req.prompt_cache_key,
        prompt_cache_retention=req.prompt_cache_retention,
        safety_identifier=req.safety_identifier,
        truncation=req.truncation or "disabled",
        user=req.user,
        metadata=req.metadata or {},
    )


def input_messages(
    req: ResponsesRequest,
    history: Sequence[Message] = (),
    signer: ReasoningSigner | None = None,
) -> list[Message]:
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
    return items_to_messages(req.input, history, signer=signer)


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
    tool_choice, visible_tools = _parse_tool_choice(req, tool_set(req))
    system = [Message(role="system", content=[TextPart(text=req.instructions or "")])]
    effort = req.reasoning.effort if req.reasoning else None
    check_tool_schemas(visible_tools, tool_choice, lambda i: f"tools[{i}].parameters")
    logprobs = _LOGPROBS_INCLUDE in (req.include or [])
    return GenerateRequest(
        request_id=request_id,
        model=req.model,
        origin="openai_responses",
        messages=[*(system if req.instructions else []), *conversation],
        tools=visible_tools,
        tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        sampling=SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            logprobs=logprobs,
            top_logprobs=(req.top_logprobs or 0) if logprobs else 0,
        ),
        max_tokens=req.max_output_tokens,
        constraint=_constraint(req),
        reasoning=ReasoningControl(
            effort=EFFORTS[effort] if effort else None, visible=True, explicit=effort is not None
        ),
        owner=owner,
        created=created,
        user=req.user,
        metadata=req.metadata or {},
        store=req.store is not False,
    )
