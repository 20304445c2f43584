"""Anthropic Messages projection: inference events → ``event:``-named SSE frames, and the message.

Owns the streaming projector (a small pure state object: no awaits, no Redis, no clock, no
random ids; everything variable comes from ``MessageContext``) and ``render``, which turns
``shared.accumulate.fold(events)`` into the non-streaming message, so the streamed and the
non-streamed answer are the same events (style.md "Projectors"). Request parsing lives in
``anthropic_messages_request``.

Wire rules kept here (wire-formats.md §4.5-4.10, §8.3): an ``event:`` line on every frame,
exactly one ``message_start``, strictly sequential content blocks with dense indexes (a block
is stopped before the next starts, and every delta matches its block's type), a
``signature_delta`` right before a thinking block's stop, ``tool_use`` blocks that start with
``input: {}``, cumulative usage in ``message_delta`` with ``input_tokens`` excluding cache
reads, and ``event: error`` for a failure after the headers.
"""

from __future__ import annotations

from typing import Literal, assert_never

import msgspec

from services.api.wire import common
from services.api.wire.common import JsonObject
from services.api.wire.sse import Frame, json_frame
from shared.accumulate import Completion, ReasoningBlock, TextBlock, ToolCallBlock
from shared.errors import ServiceError
from shared.events import (
    AnyEvent,
    Error,
    ErrorKind,
    Finish,
    ReasoningDelta,
    ReasoningEnd,
    Start,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)

__all__ = [
    "PING",
    "AnthropicProjector",
    "MessageContext",
    "error_type",
    "render",
    "service_error",
    "tool_use_id",
]

BlockKind = Literal["text", "thinking", "tool_use"]

PING = json_frame({"type": "ping"}, event="ping")
"""The keepalive frame for ``sse_response``: Anthropic clients expect ``ping`` events."""

_ERROR_TYPES: dict[ErrorKind, str] = {
    "overloaded": "overloaded_error",
    "invalid_request": "invalid_request_error",
    "context_overflow": "invalid_request_error",
    "worker_lost": "api_error",
    "cancelled": "api_error",
    "internal": "api_error",
}
_JSON_OBJECT = msgspec.json.Decoder(dict[str, object])


class MessageContext(msgspec.Struct, frozen=True, kw_only=True):
    """What the projector needs that is not in the events.

    Attributes:
        message_id: the ``id`` of the message (the request id, ``msg_…``).
        model: the model name the client asked for.
        show_thinking: False for ``thinking.display: "omitted"``: thinking blocks keep their
            place and signature but carry no text, as Anthropic's API does.
    """

    message_id: str
    model: str
    show_thinking: bool = True


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


def error_type(kind: ErrorKind) -> str:
    """Anthropic's ``error.type`` for an ``Error`` event's kind.

    Args:
        kind: the event's kind.

    Returns:
        ``overloaded_error``, ``invalid_request_error`` or ``api_error``.
    """
    return _ERROR_TYPES[kind]


def service_error(event: Error) -> ServiceError:
    """The exception a non-streaming request raises for a terminal ``Error`` event.

    The app renders it with Anthropic's envelope and status (400, 500, 529).

    Args:
        event: the terminal error.

    Returns:
        The matching ``ServiceError`` subclass instance.
    """
    # Anthropic clients honour retry-after on 529; the worker marks overload as retryable.
    retryable = event.kind == "overloaded" and event.retryable
    return common.service_error(event, retry_after=1.0 if retryable else None)


def _usage(input_tokens: int, cached: int, output_tokens: int) -> JsonObject:
    # Anthropic's input_tokens excludes cache reads; total input is the sum of the three.
    return {
        "input_tokens": max(input_tokens - cached, 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _stop(finish: Finish) -> tuple[str, str | None]:
    if finish.reason == "cancelled":
        # Anthropic has no "cancelled"; the client that cancelled is gone, and a replay reader
        # gets a message that simply ends.
        return "end_turn", None
    if finish.reason == "stop_sequence":
        return "stop_sequence", finish.stop_sequence
    return finish.reason, None


class AnthropicProjector:
    """Projects one request's events into Anthropic ``event:``/``data:`` frames.

    State: whether ``message_start`` went out, the next block index, the open block's kind
    (and tool-call index), and the last ``Usage``. Blocks open and close exactly where
    ``shared.accumulate.fold`` starts a new block, so the streamed content array equals the
    rendered one.
    """

    def __init__(self, ctx: MessageContext) -> None:
        """Start a projection.

        Args:
            ctx: ids and options of the request.
        """
        self._ctx = ctx
        self._started = False
        self._done = False
        self._next_index = 0
        self._open: BlockKind | None = None
        self._open_call: int | None = None
        self._usage: Usage | None = None

    def feed(self, event: AnyEvent) -> list[Frame]:  # noqa: C901 - one flat case per event type
        """Project one event.

        Args:
            event: the next event of the stream.

        Returns:
            The frames to send (possibly none). Events after the terminal one are ignored.
        """
        if self._done:
            return []
        match event:
            case Start():
                return self._message_start(event)
            case TextDelta():
                frames = self._switch("text")
                if event.text:
                    frames.append(self._delta({"type": "text_delta", "text": event.text}))
                return frames
            case ReasoningDelta():
                frames = self._switch("thinking")
                if event.text and self._ctx.show_thinking:
                    frames.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
                return frames
            case ReasoningEnd():
                if self._open != "thinking":
                    return []
                return self._stop_block(event.signature or "")
            case ToolCallStart():
                frames = self._stop_block()
                block: JsonObject = {
                    "type": "tool_use",
                    "id": tool_use_id(event.call_id),
                    "name": event.name,
                    "input": {},
                }
                frames.append(self._start_block("tool_use", block))
                self._open_call = event.index
                return frames
            case ToolCallArgsDelta():
                if self._open != "tool_use" or self._open_call != event.index:
                    return []
                return [self._delta({"type": "input_json_delta", "partial_json": event.fragment})]
            case ToolCallEnd():
                if self._open != "tool_use" or self._open_call != event.index:
                    return []
                return self._stop_block()
            case Usage():
                self._usage = event
                return []
            case Finish():
                return self._finish(event)
            case Error():
                self._done = True
                error = {"type": error_type(event.kind), "message": event.message}
                return [json_frame({"type": "error", "error": error}, event="error")]
            case _:
                assert_never(event)

    def close(self) -> list[Frame]:
        """Frames after the last event: none, since ``message_stop`` is sent on ``Finish``.

        Returns:
            An empty list.
        """
        return []

    def _message_start(self, event: Start) -> list[Frame]:
        if self._started:
            return []  # a resumed generation (attempt > 1) continues the same message
        self._started = True
        message: JsonObject = {
            "id": self._ctx.message_id,
            "type": "message",
            "role": "assistant",
            "model": self._ctx.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(event.prompt_tokens, event.cached_tokens, 0),
        }
        return [json_frame({"type": "message_start", "message": message}, event="message_start")]

    def _switch(self, kind: BlockKind) -> list[Frame]:
        if self._open == kind:
            return []
        frames = self._stop_block()
        empty: JsonObject = (
            {"type": "text", "text": ""}
            if kind == "text"
            else {"type": "thinking", "thinking": "", "signature": ""}
        )
        frames.append(self._start_block(kind, empty))
        return frames

    def _start_block(self, kind: BlockKind, block: JsonObject) -> Frame:
        self._open = kind
        data = {"type": "content_block_start", "index": self._next_index, "content_block": block}
        return json_frame(data, event="content_block_start")

    def _delta(self, delta: JsonObject) -> Frame:
        data = {"type": "content_block_delta", "index": self._next_index, "delta": delta}
        return json_frame(data, event="content_block_delta")

    def _stop_block(self, signature: str = "") -> list[Frame]:
        if self._open is None:
            return []
        frames: list[Frame] = []
        if self._open == "thinking":
            # Every thinking block ends with one signature_delta, even when the model's block
            # was cut short (max_tokens) or never closed: clients echo the block back with it.
            frames.append(self._delta({"type": "signature_delta", "signature": signature}))
        stop = {"type": "content_block_stop", "index": self._next_index}
        frames.append(json_frame(stop, event="content_block_stop"))
        self._open, self._open_call = None, None
        self._next_index += 1
        return frames

    def _finish(self, event: Finish) -> list[Frame]:
        self._done = True
        frames = self._stop_block()
        stop_reason, stop_sequence = _stop(event)
        usage = self._usage or Usage(input_tokens=0, output_tokens=0)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(usage.input_tokens, usage.cached_tokens, usage.output_tokens),
        }
        frames.append(json_frame(delta, event="message_delta"))
        frames.append(json_frame({"type": "message_stop"}, event="message_stop"))
        return frames


def _tool_input(arguments: str) -> JsonObject:
    # The SDK types tool_use.input as an object; a stream cut mid-call leaves partial JSON, and
    # an object is still owed (llama.cpp falls back to {} too).
    try:
        return _JSON_OBJECT.decode(arguments)
    except msgspec.DecodeError:
        return {}


def render(completion: Completion, ctx: MessageContext) -> JsonObject:
    """The non-streaming message for a folded, finished event stream.

    Args:
        completion: ``fold(events)`` of a stream that ended with ``Finish``.
        ctx: ids and options of the request.

    Returns:
        The Anthropic ``Message`` object as a JSON-ready dict.

    Raises:
        ServiceError: the stream ended with an ``Error`` (see ``service_error``).
    """
    if completion.error is not None:
        raise service_error(completion.error)
    content: list[JsonObject] = []
    for block in completion.blocks:
        match block:
            case TextBlock():
                content.append({"type": "text", "text": block.text})
            case ReasoningBlock():
                thinking = block.text if ctx.show_thinking else ""
                content.append(
                    {"type": "thinking", "thinking": thinking, "signature": block.signature or ""}
                )
            case ToolCallBlock():
                content.append(
                    {
                        "type": "tool_use",
                        "id": tool_use_id(block.call_id),
                        "name": block.name,
                        "input": _tool_input(block.arguments),
                    }
                )
            case _:
                assert_never(block)
    stop_reason, stop_sequence = (
        _stop(completion.finish) if completion.finish else ("end_turn", None)
    )
    usage = completion.usage
    if usage is None and completion.start is not None:
        usage = Usage(
            input_tokens=completion.start.prompt_tokens,
            output_tokens=0,
            cached_tokens=completion.start.cached_tokens,
        )
    usage = usage or Usage(input_tokens=0, output_tokens=0)
    return {
        "id": ctx.message_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(usage.input_tokens, usage.cached_tokens, usage.output_tokens),
    }
