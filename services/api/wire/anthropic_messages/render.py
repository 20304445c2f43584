"""Anthropic Messages render: the non-streaming ``Message`` from folded events.

Owns ``render``, which builds the message from ``shared.accumulate.fold(events)``, and the
mappings the streaming projector shares with it (tool-use ids, usage, stop reason), so the
streamed and the non-streamed answer read the same events the same way. Pure: no I/O, no
clock, no random ids.
"""

from __future__ import annotations

from typing import assert_never

import msgspec

from services.api.wire.anthropic_messages.errors import service_error
from services.api.wire.anthropic_messages.types import (
    ContentOut,
    Context,
    Message,
    StopReason,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    UsageOut,
)
from services.api.wire.common import JsonObject
from shared.accumulate import Completion, ReasoningBlock, TextBlock, ToolCallBlock
from shared.events import Finish, Usage

__all__ = ["render", "stop_details", "tool_use_id", "usage_out"]

_JSON_OBJECT = msgspec.json.Decoder(dict[str, object])


def tool_use_id(call_id: str) -> str:
    """The Anthropic ``toolu_…`` id of an internal tool-call id (deterministic, reversible).

    Args:
        call_id: the id on ``ToolCallStart`` (e.g. ``call_a1``).

    Returns:
        ``toolu_`` plus the id without its ``call_`` prefix.
    """
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + call_id.removeprefix("call_")


def usage_out(input_tokens: int, cached: int, output_tokens: int) -> UsageOut:
    """Anthropic's usage: ``input_tokens`` excludes cache reads, reported apart.

    Args:
        input_tokens: every prompt token, cached ones included.
        cached: the prompt tokens read from the prefix cache.
        output_tokens: the generated tokens.

    Returns:
        The wire usage; its three input counts sum to ``input_tokens``.
    """
    return UsageOut(
        input_tokens=max(input_tokens - cached, 0),
        cache_creation_input_tokens=0,
        cache_read_input_tokens=cached,
        output_tokens=output_tokens,
    )


def stop_details(finish: Finish) -> tuple[StopReason, str | None]:
    """The ``stop_reason`` and ``stop_sequence`` of a stream's ``Finish``.

    Args:
        finish: the stream's finish event.

    Returns:
        ``(stop_reason, stop_sequence)``; the sequence only for ``stop_sequence``.
    """
    match finish.reason:
        case "cancelled":
            # Anthropic has no "cancelled"; the client that cancelled is gone, and a replay
            # reader gets a message that simply ends.
            return "end_turn", None
        case "stop_sequence":
            return "stop_sequence", finish.stop_sequence
        case "end_turn" | "max_tokens" | "tool_use":
            return finish.reason, None
        case _:
            assert_never(finish.reason)


def _tool_input(arguments: str) -> JsonObject:
    # The SDK types tool_use.input as an object; a stream cut mid-call leaves partial JSON, and
    # an object is still owed (llama.cpp falls back to {} too).
    try:
        return _JSON_OBJECT.decode(arguments)
    except msgspec.DecodeError:
        return {}


def render(completion: Completion, ctx: Context) -> Message:
    """The non-streaming message for a folded, finished event stream.

    Args:
        completion: ``fold(events)`` of a stream that ended with ``Finish``.
        ctx: ids and options of the request.

    Returns:
        The Anthropic ``Message``; encode it with ``msgspec.json.encode``.

    Raises:
        ServiceError: the stream ended with an ``Error`` (see ``errors.service_error``).
    """
    if completion.error is not None:
        raise service_error(completion.error)
    content: list[ContentOut] = []
    for block in completion.blocks:
        match block:
            case TextBlock():
                content.append(TextOut(text=block.text))
            case ReasoningBlock():
                thinking = block.text if ctx.show_thinking else ""
                signature = block.signature or ""
                if ctx.signer is not None:
                    signature = ctx.signer.sign(block.text)
                content.append(ThinkingOut(thinking=thinking, signature=signature))
            case ToolCallBlock():
                content.append(
                    ToolUseOut(
                        id=tool_use_id(block.call_id),
                        name=block.name,
                        input=_tool_input(block.arguments),
                    )
                )
            case _:
                assert_never(block)
    stop_reason, stop_sequence = (
        stop_details(completion.finish) if completion.finish else ("end_turn", None)
    )
    usage = completion.usage
    if usage is None and completion.start is not None:
        usage = Usage(
            input_tokens=completion.start.prompt_tokens,
            output_tokens=0,
            cached_tokens=completion.start.cached_tokens,
        )
    usage = usage or Usage(input_tokens=0, output_tokens=0)
    return Message(
        id=ctx.message_id,
        model=ctx.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=usage_out(usage.input_tokens, usage.cached_tokens, usage.output_tokens),
    )
