"""Anthropic Messages projector: inference events -> ``event:``-named SSE frames.

A small pure state object: no awaits, no Redis, no clock, no random ids; everything variable
comes from ``Context``. Wire rules kept here, as Anthropic's API streams and as strict clients
such as Claude Code demand: an ``event:`` line on every frame, exactly one ``message_start``,
strictly sequential content blocks with dense indexes (a block is stopped before the next
starts, and every delta matches its block's type), a ``signature_delta`` right before a
thinking block's stop, ``tool_use`` blocks that start with ``input: {}``, cumulative usage in
``message_delta`` with ``input_tokens`` excluding cache reads, and ``event: error`` for a
failure after the headers. Blocks open and close exactly where ``shared.accumulate.fold``
starts a new block, so the streamed message equals ``render(fold(events))``.
"""

from __future__ import annotations

from typing import Literal, assert_never

from services.api.wire.anthropic_messages.errors import error_type
from services.api.wire.anthropic_messages.render import stop_details, tool_use_id, usage_out
from services.api.wire.anthropic_messages.types import (
    BlockDelta,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ContentOut,
    Context,
    ErrorDetail,
    ErrorEvent,
    InputJsonDeltaOut,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    Ping,
    SignatureDeltaOut,
    StopDetails,
    StreamEvent,
    TextDeltaOut,
    TextOut,
    ThinkingDeltaOut,
    ThinkingOut,
    ToolUseOut,
)
from services.api.wire.sse import Frame, json_frame
from shared.events import (
    AnyEvent,
    Error,
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
from shared.separators import SeparatorGate

__all__ = ["PING", "Projector"]

BlockKind = Literal["text", "thinking", "tool_use"]


def _frame(event: StreamEvent) -> Frame:
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return json_frame(event, event=tag)


PING = _frame(Ping())
"""The keepalive frame for ``sse_response``: Anthropic clients expect ``ping`` events."""


class Projector:
    """Projects one request's events into Anthropic ``event:``/``data:`` frames.

    State: whether ``message_start`` went out, the next block index, the open block's kind
    (and tool-call index), and the last ``Usage``.

    ``coalesce``: a reader's backlog of deltas may be folded into fewer ``content_block_delta``
    frames (``services.api.coalesce``): deltas carry their block index, not a position, so a
    joined one is a longer ``text``/``thinking``/``partial_json``; resuming is by entry id.
    """

    coalesce = True

    def __init__(self, ctx: Context) -> None:
        """Start a projection.

        Args:
            ctx: ids and options of the request.
        """
        self._gate = SeparatorGate()
        self._thinking = ""  # the open thinking block's text, signed when it stops
        self._ctx = ctx
        self._started = False
        self._done = False
        self._next_index = 0
        self._open: BlockKind | None = None
        self._open_call: int | None = None
        self._usage: Usage | None = None

    def feed(self, event: AnyEvent) -> list[Frame]:
        """Project one event (separator whitespace dropped first, as ``fold`` drops it).

        Args:
            event: the next event of the stream.

        Returns:
            The SSE frames to send (possibly none).
        """
        return [frame for shown in self._gate.feed(event) for frame in self._project(shown)]

    def _project(self, event: AnyEvent) -> list[Frame]:  # noqa: C901 - one flat case per event type
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
                    frames.append(self._delta(TextDeltaOut(text=event.text)))
                return frames
            case ReasoningDelta():
                frames = self._switch("thinking")
                self._thinking += event.text
                if event.text and self._ctx.show_thinking:
                    frames.append(self._delta(ThinkingDeltaOut(thinking=event.text)))
                return frames
            case ReasoningEnd():
                if self._open != "thinking":
                    return []
                return self._stop_block(event.signature or "")
            case ToolCallStart():
                frames = self._stop_block()
                block = ToolUseOut(id=tool_use_id(event.call_id), name=event.name, input={})
                frames.append(self._start_block("tool_use", block))
                self._open_call = event.index
                return frames
            case ToolCallArgsDelta():
                if self._open != "tool_use" or self._open_call != event.index:
                    return []
                return [self._delta(InputJsonDeltaOut(partial_json=event.fragment))]
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
                error = ErrorDetail(type=error_type(event.kind), message=event.message)
                return [_frame(ErrorEvent(error=error))]
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
        message = Message(
            id=self._ctx.message_id,
            model=self._ctx.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=usage_out(event.prompt_tokens, event.cached_tokens, 0),
        )
        return [_frame(MessageStart(message=message))]

    def _switch(self, kind: BlockKind) -> list[Frame]:
        if self._open == kind:
            return []
        frames = self._stop_block()
        empty: ContentOut = (
            TextOut(text="") if kind == "text" else ThinkingOut(thinking="", signature="")
        )
        frames.append(self._start_block(kind, empty))
        return frames

    def _start_block(self, kind: BlockKind, block: ContentOut) -> Frame:
        self._open = kind
        return _frame(ContentBlockStart(index=self._next_index, content_block=block))

    def _delta(self, delta: BlockDelta) -> Frame:
        return _frame(ContentBlockDelta(index=self._next_index, delta=delta))

    def _stop_block(self, signature: str = "") -> list[Frame]:
        if self._open is None:
            return []
        frames: list[Frame] = []
        if self._open == "thinking":
            # Every thinking block ends with one signature_delta, even when the model's block
            # was cut short (max_tokens) or never closed: clients echo the block back with it.
            if self._ctx.signer is not None:
                signature = self._ctx.signer.sign(self._thinking)
            frames.append(self._delta(SignatureDeltaOut(signature=signature)))
            self._thinking = ""
        frames.append(_frame(ContentBlockStop(index=self._next_index)))
        self._open, self._open_call = None, None
        self._next_index += 1
        return frames

    def _finish(self, event: Finish) -> list[Frame]:
        self._done = True
        frames = self._stop_block()
        stop_reason, stop_sequence = stop_details(event)
        usage = self._usage or Usage(input_tokens=0, output_tokens=0)
        delta = MessageDelta(
            delta=StopDetails(stop_reason=stop_reason, stop_sequence=stop_sequence),
            usage=usage_out(usage.input_tokens, usage.cached_tokens, usage.output_tokens),
        )
        frames.append(_frame(delta))
        frames.append(_frame(MessageStop()))
        return frames
