"""OpenAI Responses rendering: the ``Response`` object and its output items from events.

Owns what the streaming projector and the non-streaming path share: deterministic item ids,
building output items, the terminal status, usage and error mapping, and ``render``, which
builds the non-streaming ``Response`` from ``shared.accumulate.fold`` over the same events, so
both paths agree by construction. Pure: no I/O, no clock, no random ids.
"""

from __future__ import annotations

from typing import Literal, assert_never

import msgspec

from services.api.wire.openai_responses.call_types import CustomToolCallItem, ToolSearchCallItem
from services.api.wire.openai_responses.tools import Route, call_arguments, custom_input, routes
from services.api.wire.openai_responses.types import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    Logprob,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseError,
    ResponseStatus,
    ResponseUsage,
    SummaryText,
    TopLogprob,
)
from services.api.wire.reasoning_tokens import ReasoningSigner
from shared.accumulate import Completion, ReasoningBlock, TextBlock, ToolCallBlock
from shared.events import Error, Finish, TokenLogprob, ToolCallStart, Usage

__all__ = [
    "ItemKind",
    "build_item",
    "call_item_id",
    "entry_seconds",
    "final_response",
    "item_id",
    "logprobs_out",
    "render",
    "terminal_status",
    "wants_summary",
]

ItemKind = Literal["message", "reasoning", "function_call"]
_PREFIX: dict[ItemKind, str] = {"message": "msg", "reasoning": "rs", "function_call": "fc"}
# Codex and the SDK know these codes; anything else is a retryable server error to them.
_ERROR_CODES = {"context_overflow": "context_length_exceeded", "invalid_request": "invalid_prompt"}


def item_id(response_id: str, kind: ItemKind, output_index: int) -> str:
    """The deterministic id of an output item.

    Args:
        response_id: ``resp_...``.
        kind: the item type.
        output_index: the item's position in ``output``.

    Returns:
        e.g. ``msg_<response suffix>_0``.
    """
    return f"{_PREFIX[kind]}_{response_id.removeprefix('resp_')}_{output_index}"


_CALL_PREFIX = {"function": "fc", "custom": "ctc", "tool_search": "tsc"}


def call_item_id(response_id: str, route: Route | None, output_index: int) -> str:
    """The deterministic id of a call item, prefixed as OpenAI prefixes its kind.

    Args:
        response_id: ``resp_...``.
        route: the called tool's route (None: an undeclared name, rendered as a function).
        output_index: the item's position in ``output``.

    Returns:
        e.g. ``fc_<response suffix>_2`` or ``ctc_<response suffix>_2``.
    """
    prefix = _CALL_PREFIX[route.kind if route is not None else "function"]
    return f"{prefix}_{response_id.removeprefix('resp_')}_{output_index}"


def _call_id(call_id: str) -> str:
    # Clients key tool results on call ids of the form call_...; keep ours recognisable.
    return call_id if call_id.startswith("call_") else f"call_{call_id}"


def logprobs_out(entries: list[TokenLogprob] | None) -> list[Logprob]:
    """Token logprobs in the Responses shape (``bytes`` filled in when the event lacks them).

    Args:
        entries: the event's logprobs, if any.

    Returns:
        One ``Logprob`` per token.
    """
    return [
        Logprob(
            token=e.token,
            bytes=e.bytes if e.bytes is not None else list(e.token.encode()),
            logprob=e.logprob,
            top_logprobs=[
                TopLogprob(
                    token=t.token,
                    bytes=t.bytes if t.bytes is not None else list(t.token.encode()),
                    logprob=t.logprob,
                )
                for t in e.top
            ],
        )
        for e in entries or []
    ]


def _usage(usage: Usage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    return ResponseUsage(
        input_tokens=usage.input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
        total_tokens=usage.input_tokens + usage.output_tokens,
    )


def terminal_status(finish: Finish | None, error: Error | None) -> tuple[ResponseStatus, str]:
    """The response status and the lifecycle event type that announces it.

    Args:
        finish: the stream's ``Finish``, if it ended normally.
        error: the stream's ``Error``, if it failed.

    Returns:
        ``(status, lifecycle event type)``; ``in_progress`` while neither has arrived.
    """
    if error is not None and error.kind == "cancelled":
        # Cancelled before any worker started it: the same end as a cancel after the start.
        return "cancelled", "response.incomplete"
    if error is not None:
        return "failed", "response.failed"
    if finish is None:
        return "in_progress", "response.in_progress"
    if finish.reason == "max_tokens":
        return "incomplete", "response.incomplete"
    if finish.reason == "cancelled":
        # The SDK has no response.cancelled event; incomplete is the closest non-success end.
        return "cancelled", "response.incomplete"
    return "completed", "response.completed"


def final_response(
    skeleton: Response,
    output: list[OutputItem],
    usage: Usage | None,
    finish: Finish | None,
    error: Error | None,
    completed_at: int | None = None,
) -> Response:
    """The skeleton completed with its output, usage, status and error.

    Args:
        skeleton: the request echo.
        output: the finished items.
        usage: the stream's ``Usage``, if any.
        finish: the stream's ``Finish``, if any.
        error: the stream's ``Error``, if any.
        completed_at: unix seconds the terminal event was logged (kept only once it ended).

    Returns:
        The response as of those events.
    """
    status, _ = terminal_status(finish, error)
    incomplete = finish is not None and finish.reason == "max_tokens"
    return msgspec.structs.replace(
        skeleton,
        status=status,
        output=output,
        usage=_usage(usage),
        error=_error(error),
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        completed_at=completed_at if status != "in_progress" else None,
    )


def _error(error: Error | None) -> ResponseError | None:
    if error is None or error.kind == "cancelled":
        return None  # a cancelled response carries no error, as OpenAI's cancelled ones do
    code = _ERROR_CODES.get(error.kind, "server_error")
    return ResponseError(code=code, message=error.message, retryable=error.retryable)


def build_item(
    kind: ItemKind,
    iid: str,
    status: ItemStatus,
    text: str,
    logprobs: list[Logprob],
    call: ToolCallStart | None,
    route: Route | None = None,
    *,
    summary: bool = False,
    signer: ReasoningSigner | None = None,
) -> OutputItem:
    """One output item of ``kind`` in ``status``.

    Args:
        kind: message, reasoning or function_call.
        iid: the item id (``item_id``).
        status: the item status.
        text: the message or reasoning text, or the call's arguments.
        logprobs: a message's token logprobs.
        call: the ``ToolCallStart`` of a function call (None otherwise).
        route: how the called tool maps back onto the wire (custom and tool-search calls
            become their own item types, namespaced ones carry ``namespace``).
        summary: a reasoning item also carries its text as a ``summary_text`` part.
        signer: a finished reasoning item also carries its text signed as ``encrypted_content``.

    Returns:
        The item.
    """
    if kind == "message":
        return MessageItem(
            id=iid, status=status, content=[OutputText(text=text, logprobs=logprobs)]
        )
    if kind == "reasoning":
        parts = [SummaryText(text=text)] if summary else []
        item = ReasoningItem(
            id=iid, status=status, summary=parts, content=[ReasoningText(text=text)]
        )
        if signer is not None and status != "in_progress":
            item.encrypted_content = signer.sign(text)
        return item
    assert call is not None
    call_id = _call_id(call.call_id)
    if route is not None and route.kind == "custom":
        return CustomToolCallItem(
            id=iid,
            status=status,
            call_id=call_id,
            input=custom_input(text) if text else "",
            name=route.name,
            namespace=route.namespace,
        )
    if route is not None and route.kind == "tool_search":
        arguments = call_arguments(text) if text else {}
        return ToolSearchCallItem(id=iid, status=status, arguments=arguments, call_id=call_id)
    return FunctionCallItem(
        id=iid,
        status=status,
        arguments=text,
        call_id=call_id,
        name=route.name if route is not None else call.name,
        namespace=route.namespace if route is not None else None,
    )


def render(
    completion: Completion,
    skeleton: Response,
    *,
    completed_at: int | None = None,
    signer: ReasoningSigner | None = None,
) -> Response:
    """Build the non-streaming response (also what GET returns) from folded events.

    Args:
        completion: ``fold(events)``; may be partial (still generating).
        skeleton: the request echo from ``request.skeleton``.
        completed_at: when the terminal event was logged (``entry_seconds`` of its entry id).
        signer: given when the request included ``reasoning.encrypted_content``.

    Returns:
        The response; the last item is ``incomplete`` when generation did not end naturally,
        ``in_progress`` while it has not ended.
    """
    status, _ = terminal_status(completion.finish, completion.error)
    tool_routes = routes(skeleton.tools)
    output: list[OutputItem] = []
    for index, block in enumerate(completion.blocks):
        last = index == len(completion.blocks) - 1
        item_status: ItemStatus = "completed"
        if last and status == "in_progress":
            item_status = "in_progress"
        elif last and status != "completed":
            item_status = "incomplete"
        match block:
            case TextBlock():
                iid = item_id(skeleton.id, "message", index)
                logprobs = logprobs_out(block.logprobs)
                output.append(build_item("message", iid, item_status, block.text, logprobs, None))
            case ReasoningBlock():
                iid = item_id(skeleton.id, "reasoning", index)
                output.append(
                    build_item(
                        "reasoning",
                        iid,
                        item_status,
                        block.text,
                        [],
                        None,
                        summary=wants_summary(skeleton),
                        signer=signer,
                    )
                )
            case ToolCallBlock():
                route = tool_routes.get(block.name)
                iid = call_item_id(skeleton.id, route, index)
                call = ToolCallStart(index=block.index, call_id=block.call_id, name=block.name)
                output.append(
                    build_item("function_call", iid, item_status, block.arguments, [], call, route)
                )
            case _:
                assert_never(block)
    return final_response(
        skeleton, output, completion.usage, completion.finish, completion.error, completed_at
    )


def wants_summary(skeleton: Response) -> bool:
    """Whether the request asked for reasoning summaries (``reasoning.summary``).

    sluice has no second model to summarize with, so the summary is the reasoning itself,
    verbatim: one ``summary_text`` part per reasoning item, streamed as the reasoning streams.
    Clients that only read summaries (Codex's display, the Vercel AI SDK) then see it.

    Args:
        skeleton: the request echo.

    Returns:
        True for ``auto``, ``concise`` and ``detailed``.
    """
    return skeleton.reasoning.summary in ("auto", "concise", "detailed")


def entry_seconds(entry_id: str | bytes) -> int:
    """The unix second a Redis stream entry was logged at (its id is ``<ms>-<seq>``).

    The event log is the durable clock: every reader of a stored response, live or replayed,
    computes the same ``completed_at`` from the terminal event's entry id.

    Args:
        entry_id: the entry id.

    Returns:
        Whole seconds.
    """
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0]) // 1000
