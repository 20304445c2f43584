"""The inference event vocabulary: the contract between workers and the API.

A closed msgspec tagged union with explicit string tags. Workers publish these on a per-request
Redis stream; the API projects them into each wire format. Events carry domain data only: no
``choices``, ``delta``, ``content_block`` or vendor id prefixes.

Invariants (checked by ``tests/invariants.py`` over every stream any test produces):

* exactly one terminal event (``Finish`` or ``Error``), and it is last;
* ``Start`` is first, except that an ``Error`` may come first (rejected before generation);
* tool calls never overlap: ``ToolCallStart(i)``, ``ToolCallArgsDelta(i)*``, ``ToolCallEnd(i)``,
  then ``i + 1``; indexes are dense from 0;
* the concatenated ``ToolCallArgsDelta.fragment`` of a call equals its ``ToolCallEnd.arguments``;
* the ``token_ids`` of all events, in order, are exactly the generated tokens (marker tokens ride
  on the event they open or close, held-back tokens on ``Finish``), which makes exact replay and
  worker failover possible.

Evolution: new fields get defaults and go last; a tag is never reused or retyped. Deploy
consumers (API) before producers (workers).
"""

from __future__ import annotations

from itertools import chain
from typing import Literal

import msgspec

__all__ = [
    "TERMINAL",
    "AnyEvent",
    "Delta",
    "Error",
    "ErrorKind",
    "Event",
    "Finish",
    "FinishReason",
    "ReasoningDelta",
    "ReasoningEnd",
    "Start",
    "TextDelta",
    "TokenLogprob",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "TopLogprob",
    "Usage",
    "delta_text",
    "is_terminal",
    "join_deltas",
    "joinable",
    "joined",
]

FinishReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "cancelled"]
ErrorKind = Literal[
    "invalid_request", "context_overflow", "overloaded", "worker_lost", "cancelled", "internal"
]


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every event; ``type`` is the explicit wire tag."""


class TopLogprob(msgspec.Struct, frozen=True):
    """One alternative token and its log-probability."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, frozen=True):
    """Log-probability of one sampled token, with the requested top alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top: list[TopLogprob] = []


class Start(Event, frozen=True, tag="start"):
    """The worker accepted the prompt (prefill done or resumed). Carries no text."""

    request_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int = 0
    attempt: int = 1  # > 1 when another worker continues a lost worker's generation


class TextDelta(Event, frozen=True, tag="text"):
    """Visible answer text."""

    text: str
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None


class ReasoningDelta(Event, frozen=True, tag="reasoning"):
    """Body of a reasoning block; the marker text itself is never included."""

    text: str
    token_ids: list[int] = []


class ReasoningEnd(Event, frozen=True, tag="reasoning_end"):
    """Closes a reasoning block, so projectors need not peek ahead to close it."""

    signature: str | None = None
    token_ids: list[int] = []


class ToolCallStart(Event, frozen=True, tag="tool_call_start"):
    """A tool call whose name is known; arguments follow as fragments."""

    index: int
    call_id: str
    name: str
    token_ids: list[int] = []


class ToolCallArgsDelta(Event, frozen=True, tag="tool_call_args"):
    """A fragment of the call's JSON arguments; fragments concatenate to the final arguments."""

    index: int
    fragment: str
    token_ids: list[int] = []


class ToolCallEnd(Event, frozen=True, tag="tool_call_end"):
    """The call is complete; ``arguments`` is a JSON object serialized as text."""

    index: int
    arguments: str
    token_ids: list[int] = []


class Usage(Event, frozen=True, tag="usage"):
    """Token accounting; exactly once, right before the terminal event."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


class Finish(Event, frozen=True, tag="finish"):
    """Terminal: generation ended normally (or was cancelled)."""

    reason: FinishReason
    stop_sequence: str | None = None
    token_ids: list[int] = []  # generated tokens not carried by any delta (held stop text, eos)


class Error(Event, frozen=True, tag="error"):
    """Terminal: generation failed or was rejected."""

    kind: ErrorKind
    message: str
    retryable: bool = False


AnyEvent = (
    Start
    | TextDelta
    | ReasoningDelta
    | ReasoningEnd
    | ToolCallStart
    | ToolCallArgsDelta
    | ToolCallEnd
    | Usage
    | Finish
    | Error
)

TERMINAL = (Finish, Error)


def is_terminal(event: AnyEvent) -> bool:
    """Return True for the events that end a stream."""
    return isinstance(event, TERMINAL)


Delta = TextDelta | ReasoningDelta | ToolCallArgsDelta


def joinable(a: AnyEvent, b: AnyEvent) -> bool:
    """Whether ``b`` may be appended to delta ``a`` as one delta: the same kind (text with text,
    reasoning with reasoning, a call's argument fragments with the same call's), and for text,
    logprobs on both or on neither."""
    if isinstance(a, TextDelta):
        return isinstance(b, TextDelta) and (a.logprobs is None) == (b.logprobs is None)
    if isinstance(a, ReasoningDelta):
        return isinstance(b, ReasoningDelta)
    if isinstance(a, ToolCallArgsDelta):
        return isinstance(b, ToolCallArgsDelta) and a.index == b.index
    return False


def delta_text(event: Delta) -> str:
    """The text a delta adds (a fragment, for tool-call arguments)."""
    return event.fragment if isinstance(event, ToolCallArgsDelta) else event.text


def joined(run: list[AnyEvent]) -> AnyEvent:
    """One delta equal to the concatenation of a ``joinable`` run: its text, token ids and
    logprobs in order (the stream's invariants hold for it as they did for the parts)."""
    first = run[0]
    if len(run) == 1:
        return first
    text = "".join(delta_text(e) for e in run)  # type: ignore[arg-type]
    token_ids = list(chain.from_iterable(e.token_ids for e in run))  # type: ignore[union-attr]
    if isinstance(first, TextDelta):
        logprobs = None
        if first.logprobs is not None:
            logprobs = list(chain.from_iterable(e.logprobs or [] for e in run))  # type: ignore[union-attr]
        return TextDelta(text=text, token_ids=token_ids, logprobs=logprobs)
    if isinstance(first, ReasoningDelta):
        return ReasoningDelta(text=text, token_ids=token_ids)
    assert isinstance(first, ToolCallArgsDelta)
    return ToolCallArgsDelta(index=first.index, fragment=text, token_ids=token_ids)


def join_deltas(events: list[AnyEvent]) -> list[AnyEvent]:
    """``events`` with each run of ``joinable`` deltas joined into one; others pass unchanged."""
    out: list[AnyEvent] = []
    run: list[AnyEvent] = []
    for event in events:
        if run and not joinable(run[-1], event):
            out.append(joined(run))
            run = []
        if isinstance(event, Delta):
            run.append(event)
        else:
            out.append(event)
    if run:
        out.append(joined(run))
    return out
