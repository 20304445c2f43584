"""Ollama's response bodies as msgspec Structs, and the projection ``Context``.

Field names and order follow Ollama's own JSON (``api/types.go``): ``model``, ``created_at``,
then ``message`` (chat) or ``response`` (generate), ``done_reason``, ``done``, and the timing
and count metrics on the final object only. Fields Ollama marks ``omitempty`` default to None
and are omitted (``omit_defaults``); ``content``, ``response`` and ``done`` are always present,
as Ollama always writes them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "ChatChunk",
    "Context",
    "ErrorLine",
    "Function",
    "GenerateChunk",
    "LogprobOut",
    "MessageOut",
    "Metrics",
    "Timing",
    "ToolCallOut",
    "TopLogprobOut",
]

Mode = Literal["chat", "generate"]


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """What a projection needs beyond the events: the endpoint, model and options."""

    mode: Mode
    model: str
    created_ms: int  # the request's creation (the job's ``created``), epoch milliseconds
    show_thinking: bool = True  # False: ``think: false`` (reasoning the model writes is dropped)
    logprobs: bool = False


class Timing(msgspec.Struct, frozen=True, kw_only=True):
    """When the generation started and ended, epoch ms, read off the event log's entry ids.

    Entry ids are the log's own clock, so every replay reports the same durations.
    """

    start_ms: int | None = None
    end_ms: int | None = None


class Function(msgspec.Struct, frozen=True, kw_only=True):
    """A call's function: ``index`` (newer Ollama), ``name`` and ``arguments`` as an object."""

    index: int
    name: str
    arguments: dict[str, object]


class ToolCallOut(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call as Ollama writes it (``id`` as newer Ollama versions do)."""

    id: str
    function: Function


class MessageOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The assistant message of a chat chunk (a fragment while streaming)."""

    # No defaults on role and content: ``omit_defaults`` would drop them, and Ollama always
    # writes both.
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprobOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An alternative token."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One sampled token's log-probability, with its top alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobOut] | None = None


class Metrics(msgspec.Struct, frozen=True, kw_only=True):
    """The final object's counts and durations (nanoseconds)."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class ChatChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One ``/api/chat`` line, or the whole non-streaming body."""

    model: str
    created_at: str
    message: MessageOut
    done_reason: str | None = None
    done: bool  # no default: omitted defaults would drop ``done: false``
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[LogprobOut] | None = None


class GenerateChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One ``/api/generate`` line, or the whole non-streaming body."""

    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done_reason: str | None = None
    done: bool  # no default: omitted defaults would drop ``done: false``
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[LogprobOut] | None = None


class ErrorLine(msgspec.Struct, frozen=True):
    """A failure, as Ollama writes it in-band and as an HTTP error body."""

    error: str
