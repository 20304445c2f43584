"""Anthropic Messages request parsing: raw JSON body → canonical ``GenerateRequest``.

Owns decoding and validating the ``POST /v1/messages`` (and ``/count_tokens``) body and its
translation into the format-agnostic job; the body's Structs live in ``request_types``, and
``turns`` converts its system prompt and turns into the job's messages. It
must not render templates, touch Redis or know about the response side; every problem
becomes ``InvalidRequest`` with the offending ``param``, which the app renders as Anthropic's
400 ``invalid_request_error`` (never FastAPI's 422).

What clients actually send, and so what is accepted: ``system`` as a string or text blocks,
``role: "system"`` turns inside ``messages`` (Claude Code), ``thinking`` / ``redacted_thinking``
blocks replayed with any or an empty signature (always accepted), sampling knobs the 1.x+ SDKs
only pass through ``extra_body``, and a final assistant turn: a prefill (``prefill``).
"""

from __future__ import annotations

import re

import msgspec

from services.api.wire.anthropic_messages.prefill import prefilled
from services.api.wire.anthropic_messages.request_types import (
    BLOCK_TYPES,
    MessagesRequest,
    Metadata,
    Tool,
    ToolChoiceParam,
)
from services.api.wire.anthropic_messages.turns import messages
from services.api.wire.common import decode_body, error_location, reasoning_effort
from services.api.wire.constraints import anthropic_format, check_tool_schemas
from services.api.wire.extra_fields import extra_fields, refuse
from services.api.wire.sampling import check_sampling
from shared.errors import InvalidRequest
from shared.jobs import (
    Constraint,
    GenerateRequest,
    ReasoningControl,
    SamplingParams,
    ToolChoice,
    ToolDef,
)

__all__ = [
    "MessagesRequest",
    "build_job",
    "ignored_tools",
    "parse_count_tokens_request",
    "parse_request",
]

_DECODER = msgspec.json.Decoder(MessagesRequest)
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def parse_request(body: bytes) -> MessagesRequest:
    """Decode and validate a ``POST /v1/messages`` body.

    Args:
        body: the raw request body.

    Returns:
        The decoded request, with ``max_tokens`` present.

    Raises:
        InvalidRequest: malformed JSON, a wrong field type, an unsupported content block type,
            a missing ``max_tokens`` or an out-of-range parameter.
    """
    req = parse_count_tokens_request(body)
    if req.max_tokens is None:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    return req


def parse_count_tokens_request(body: bytes) -> MessagesRequest:
    """Decode a ``POST /v1/messages/count_tokens`` body (``max_tokens`` is not required).

    Args:
        body: the raw request body.

    Returns:
        The decoded request.

    Raises:
        InvalidRequest: as for ``parse_request``, except for ``max_tokens``.
    """
    req = decode_body(_DECODER, body, _validation_error)
    refuse(extra_fields(body, MessagesRequest))
    _validate(req)
    return req


def _validation_error(exc: msgspec.ValidationError) -> InvalidRequest:
    text = str(exc)
    what, path = error_location(text)
    missing = _MISSING.match(text)
    if missing:
        field = f"{path}.{missing.group('field')}" if path else missing.group("field")
        return InvalidRequest(f"{field}: Field required", param=field)
    if path is not None and path.endswith(".type") and "content" in path:
        where = path.removesuffix(".type")
        # A tool_result's own content holds text blocks only; a turn holds the five kinds.
        kinds = "text" if where.count("content") > 1 else BLOCK_TYPES
        message = f"{where}: {what}; supported content block types: {kinds}"
        return InvalidRequest(message, param=where)
    return InvalidRequest(f"{path}: {what}" if path else text, param=path or None)


def _validate(req: MessagesRequest) -> None:
    if not req.model:
        raise InvalidRequest("model: Field required", param="model")
    for i, stop in enumerate(req.stop_sequences or []):
        if not stop.strip():
            raise InvalidRequest(
                "stop_sequences: each stop sequence must contain non-whitespace",
                param=f"stop_sequences[{i}]",
            )
    _constraint(req)  # a schema that cannot compile is rejected before anything is enqueued
    _validate_tools(req)
    check_tool_schemas(
        _tools(req), _tool_choice(req.tool_choice), lambda i: f"tools[{i}].input_schema"
    )


def _constraint(req: MessagesRequest) -> Constraint | None:
    if req.output_format is not None:
        return anthropic_format(req.output_format, "output_format")
    return anthropic_format(req.output_config and req.output_config.format, "output_config.format")


def _tools(req: MessagesRequest) -> list[ToolDef]:
    return [
        ToolDef(
            name=t.name,
            description=t.description,
            parameters=t.input_schema,
            strict=bool(t.strict),
        )
        for t in req.tools or []
        if _is_client_tool(t)
    ]


def _is_client_tool(tool: Tool) -> bool:
    return tool.type in (None, "custom")


def ignored_tools(req: MessagesRequest) -> list[str]:
    """The names of the versioned (server or Anthropic-defined) tools left out of the prompt.

    ``web_search_20250305``, ``code_execution_*``, ``bash_*`` and the like run on Anthropic's
    side or need a model trained on them; sluice accepts them, does not offer them to the model
    and names them in the ``x-sluice-ignored-tools`` response header.

    Args:
        req: the parsed request.

    Returns:
        Their names, in request order.
    """
    return [t.name for t in req.tools or [] if not _is_client_tool(t)]


def _validate_tools(req: MessagesRequest) -> None:
    names = set()
    ignored = set(ignored_tools(req))
    for i, tool in enumerate(req.tools or []):
        if not _is_client_tool(tool):
            continue
        if not tool.name:
            raise InvalidRequest(f"tools[{i}].name: Field required", param=f"tools[{i}].name")
        names.add(tool.name)
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and choice.name in ignored:
        raise InvalidRequest(
            f"tool_choice.name: {choice.name!r} is a server tool this server cannot run",
            param="tool_choice.name",
        )
    if choice is not None and choice.type in ("any", "tool") and not names:
        raise InvalidRequest(
            f"tool_choice: type {choice.type!r} requires tools", param="tool_choice"
        )
    if choice is not None and choice.type == "tool" and choice.name not in names:
        raise InvalidRequest(
            f"tool_choice.name: no tool named {choice.name!r} in tools", param="tool_choice.name"
        )
    if (
        req.thinking is not None
        and req.thinking.type == "enabled"
        and not req.thinking.budget_tokens
    ):
        raise InvalidRequest(
            "thinking.budget_tokens: Field required", param="thinking.budget_tokens"
        )


# -- translation to the canonical job --------------------------------------------------------


def build_job(
    req: MessagesRequest, *, request_id: str, owner: str = "", created: float = 0.0
) -> GenerateRequest:
    """Translate a parsed request into the canonical job.

    Args:
        req: the parsed request.
        request_id: the request id (also the Anthropic message id).
        owner: the authenticated owner id.
        created: unix seconds the API accepted the request.

    Returns:
        A job without prompt ids; ``submit`` renders and tokenizes it.

    Raises:
        InvalidRequest: a block sits in a turn whose role cannot carry it (``tool_use`` in a
            user turn, ``tool_result`` in an assistant or system turn).
    """
    metadata = req.metadata or Metadata()
    return GenerateRequest(
        request_id=request_id,
        model=req.model,
        origin="anthropic_messages",
        messages=messages(req),
        tools=_tools(req),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
        # Anthropic's own, narrower ranges (temperature up to 1) are on MessagesRequest
        sampling=check_sampling(
            SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k or None,  # 0 means "no top-k" in every sampler we know
            )
        ),
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences or []),
        reasoning=_reasoning(req),
        constraint=_constraint(req),
        owner=owner,
        created=created,
        user=metadata.user_id,
        metadata={"script": metadata.script} if metadata.script else {},
        continue_final=prefilled(req),
    )


def _tool_choice(choice: ToolChoiceParam | None) -> ToolChoice:
    match None if choice is None else choice.type:
        case None | "auto":
            return ToolChoice(mode="auto")
        case "any":
            return ToolChoice(mode="required")
        case "none":
            return ToolChoice(mode="none")
        case _:
            return ToolChoice(mode="named", name=choice.name if choice else None)


def _reasoning(req: MessagesRequest) -> ReasoningControl:
    effort = req.output_config.effort if req.output_config else None
    mapped = reasoning_effort(effort, "output_config.effort")
    thinking = req.thinking
    if thinking is None:
        return ReasoningControl(effort=mapped, explicit=mapped is not None)
    if thinking.type in ("disabled", "between_tools"):
        return ReasoningControl(effort="none", explicit=True)
    return ReasoningControl(
        effort=mapped,
        budget_tokens=thinking.budget_tokens if thinking.type == "enabled" else None,
        visible=thinking.display != "omitted",
        explicit=True,
    )
