"""Fold an event stream into a neutral ``Completion``.

Every non-streaming response is ``render(fold(events))`` in its wire module, so streamed and
non-streamed answers cannot diverge: they are the same events.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from shared.events import (
    AnyEvent,
    Error,
    Finish,
    ReasoningDelta,
    ReasoningEnd,
    Start,
    TextDelta,
    TokenLogprob,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from shared.separators import SeparatorGate

__all__ = ["Block", "Completion", "ReasoningBlock", "TextBlock", "ToolCallBlock", "fold"]


class TextBlock(msgspec.Struct, kw_only=True):
    """A run of answer text."""

    text: str = ""
    logprobs: list[TokenLogprob] = []


class ReasoningBlock(msgspec.Struct, kw_only=True):
    """A reasoning block."""

    text: str = ""
    signature: str | None = None
    closed: bool = False  # its ReasoningEnd arrived (the model wrote its close marker)


class ToolCallBlock(msgspec.Struct, kw_only=True):
    """A complete (or, if the stream was cut, partial) tool call."""

    index: int
    call_id: str
    name: str
    arguments: str = ""


Block = TextBlock | ReasoningBlock | ToolCallBlock


class Completion(msgspec.Struct, kw_only=True):
    """The folded result of one generation, blocks in the order they were produced."""

    start: Start | None = None
    blocks: list[Block] = []
    usage: Usage | None = None
    finish: Finish | None = None
    error: Error | None = None

    @property
    def text(self) -> str:
        """All answer text."""
        return "".join(b.text for b in self.blocks if isinstance(b, TextBlock))

    @property
    def reasoning(self) -> str:
        """All reasoning text."""
        return "".join(b.text for b in self.blocks if isinstance(b, ReasoningBlock))

    @property
    def tool_calls(self) -> list[ToolCallBlock]:
        """The tool calls in index order."""
        return [b for b in self.blocks if isinstance(b, ToolCallBlock)]


def fold(events: Iterable[AnyEvent]) -> Completion:  # noqa: C901 - one flat case per event type
    """Fold events into a ``Completion``; adjacent deltas of one kind merge into one block.

    Whitespace that only separates reasoning and tool calls is dropped first
    (``shared.separators``), exactly as every streaming projector drops it.
    """
    out = Completion()
    reasoning_open = False
    gate = SeparatorGate()
    for event in (shown for raw in events for shown in gate.feed(raw)):
        last = out.blocks[-1] if out.blocks else None
        match event:
            case Start():
                out.start = event
            case TextDelta():
                if not isinstance(last, TextBlock):
                    last = TextBlock()
                    out.blocks.append(last)
                last.text += event.text
                if event.logprobs:
                    last.logprobs = [*last.logprobs, *event.logprobs]
            case ReasoningDelta():
                if not (isinstance(last, ReasoningBlock) and reasoning_open):
                    last = ReasoningBlock()
                    out.blocks.append(last)
                    reasoning_open = True
                last.text += event.text
            case ReasoningEnd():
                if isinstance(last, ReasoningBlock) and reasoning_open:
                    last.signature = event.signature
                    last.closed = True
                reasoning_open = False
            case ToolCallStart():
                out.blocks.append(
                    ToolCallBlock(index=event.index, call_id=event.call_id, name=event.name)
                )
            case ToolCallArgsDelta():
                if isinstance(last, ToolCallBlock) and last.index == event.index:
                    last.arguments += event.fragment
            case ToolCallEnd():
                if isinstance(last, ToolCallBlock) and last.index == event.index:
                    last.arguments = event.arguments
            case Usage():
                out.usage = event
            case Finish():
                out.finish = event
            case Error():
                out.error = event
    return out
