"""Whitespace that only separates markers is not content: the one rule every consumer applies.

Chat templates put newlines between ``</think>`` and the answer, between the reasoning and a
``<tool_call>``, and between parallel calls. The worker reports those newlines as text, since
it cannot know what comes next, but the real APIs never show them: Chat Completions answers
``content: null`` for a reasoning model's tool call, Responses has no whitespace ``message``
item, Anthropic no whitespace ``text`` block. ``SeparatorGate`` rewrites an event stream so
that a run of whitespace-only ``TextDelta``s disappears when it touches a reasoning or tool-call
event on either side:

- after a marker, whitespace is held; it is dropped when the next marker, the end, or the
  first real text comes (the text then starts at its first visible character, whether or not
  the tokenizer put the separator in a token of its own);
- before any marker, whitespace is held until it is clear what follows: real text releases it
  (it is the answer's own), a marker drops it, and the end releases it (a whitespace-only
  answer with no markers is still the answer).

Text that has started flows through untouched. ``fold`` and every projector run the same gate,
so streamed and non-streamed answers agree. Only text is affected: usage still counts every
token generated. Pure and incremental: it holds at most the current whitespace run.
"""

from __future__ import annotations

import msgspec

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

__all__ = ["SeparatorGate"]

_MARKERS = (ReasoningDelta, ReasoningEnd, ToolCallStart, ToolCallArgsDelta, ToolCallEnd)


class SeparatorGate:
    """Feed events in order; get back the events to show, separator whitespace removed."""

    def __init__(self) -> None:
        """Start before any event."""
        self._held: list[TextDelta] = []
        self._in_text = False  # real text has started and flows through
        self._after_marker = False  # the last non-text event was reasoning or a tool call

    def feed(self, event: AnyEvent) -> list[AnyEvent]:
        """Pass one event through the gate.

        Args:
            event: the next event of the stream.

        Returns:
            The events to project now, in order (possibly none, possibly held ones first).
        """
        if isinstance(event, TextDelta):
            if self._in_text:
                return [event]
            self._held.append(event)
            if not event.text.strip():
                return []
            held, self._held = self._held, []
            self._in_text = True
            if self._after_marker:
                # The separator before the text is not the text's, however the tokens split it.
                return [msgspec.structs.replace(event, text=event.text.lstrip())]
            return list(held)
        if isinstance(event, _MARKERS):
            self._held, self._in_text, self._after_marker = [], False, True
            return [event]
        if isinstance(event, Usage | Finish | Error):
            held, self._held = self._held, []
            if self._after_marker:
                return [event]
            return [*held, event]
        assert isinstance(event, Start)
        return [event]
