"""The non-streaming Ollama body from ``fold(events)``, and the pieces the projector shares.

A non-streaming answer is Ollama's final object with the whole message (or ``response``) in
it, exactly what the streamed lines concatenate to. Timestamps and durations come from the
request's creation time and the event log's entry ids (``Timing``), never from a clock here, so
a replay answers the same bytes. Durations map onto sluice's stages as well as they can:
``load_duration`` is 0 (one model per worker, always loaded), ``prompt_eval_duration`` runs from
the request's creation to the worker's ``Start`` (queueing and prefill), ``eval_duration`` from
``Start`` to the terminal event.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from services.api.wire.ollama.types import (
    ChatChunk,
    Context,
    Function,
    GenerateChunk,
    LogprobOut,
    MessageOut,
    Metrics,
    Timing,
    ToolCallOut,
    TopLogprobOut,
)
from shared.accumulate import Completion, TextBlock, ToolCallBlock
from shared.events import Finish, FinishReason, TokenLogprob, Usage

__all__ = [
    "done_reason",
    "logprobs_out",
    "metrics",
    "render",
    "timestamp",
    "tool_call_out",
]

# Ollama says "stop" for every natural end (tool calls included) and "length" at num_predict.
_DONE_REASONS: dict[FinishReason, str] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "stop",
    "max_tokens": "length",
    "cancelled": "cancelled",
}
_NS_PER_MS = 1_000_000


def timestamp(ms: int) -> str:
    """Ollama's ``created_at``: RFC 3339 in UTC with a ``Z``.

    Args:
        ms: epoch milliseconds.

    Returns:
        e.g. ``2025-01-02T03:04:05.678000Z``.
    """
    when = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


def done_reason(finish: Finish | None) -> str:
    """Ollama's ``done_reason`` for a finish (``stop`` when the stream ended without one)."""
    return "stop" if finish is None else _DONE_REASONS[finish.reason]


def metrics(ctx: Context, timing: Timing, usage: Usage | None) -> Metrics:
    """The final object's counts and nanosecond durations.

    Args:
        ctx: the projection context (its ``created_ms`` starts the clock).
        timing: when the generation started and ended, from the log.
        usage: the stream's ``Usage``, if it came.

    Returns:
        The metrics; a stage with no timestamp lasts 0.
    """
    start = timing.start_ms if timing.start_ms is not None else ctx.created_ms
    end = timing.end_ms if timing.end_ms is not None else start
    created = min(ctx.created_ms, start)
    return Metrics(
        total_duration=max(0, end - created) * _NS_PER_MS,
        load_duration=0,
        prompt_eval_count=usage.input_tokens if usage else 0,
        prompt_eval_duration=(start - created) * _NS_PER_MS,
        eval_count=usage.output_tokens if usage else 0,
        eval_duration=max(0, end - start) * _NS_PER_MS,
    )


def tool_call_out(index: int, call_id: str, name: str, arguments: str) -> ToolCallOut:
    """One call in Ollama's shape: the arguments as a JSON object, not as text.

    Args:
        index: the call's index in the message.
        call_id: sluice's call id.
        name: the function name.
        arguments: the call's arguments as the model wrote them (a JSON object as text).

    Returns:
        The call; arguments that are not a JSON object (a stream cut mid-call) become ``{}``.
    """
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = {}
    args = parsed if isinstance(parsed, dict) else {}
    return ToolCallOut(id=call_id, function=Function(index=index, name=name, arguments=args))


def logprobs_out(logprobs: list[TokenLogprob]) -> list[LogprobOut]:
    """Ollama's ``logprobs`` entries for sampled tokens."""
    return [
        LogprobOut(
            token=lp.token,
            logprob=lp.logprob,
            bytes=lp.bytes,
            top_logprobs=[
                TopLogprobOut(token=t.token, logprob=t.logprob, bytes=t.bytes) for t in lp.top
            ],
        )
        for lp in logprobs
    ]


def _calls(blocks: list[ToolCallBlock]) -> list[ToolCallOut] | None:
    calls = [tool_call_out(b.index, b.call_id, b.name, b.arguments) for b in blocks]
    return calls or None


def render(completion: Completion, ctx: Context, timing: Timing) -> ChatChunk | GenerateChunk:
    """The non-streaming body of a finished request.

    Args:
        completion: the fold of the request's events (the route raises for an ``Error``).
        ctx: the projection context.
        timing: start and end from the event log.

    Returns:
        A ``ChatChunk`` (``/api/chat``) or ``GenerateChunk`` (``/api/generate``) with ``done``.
    """
    thinking = completion.reasoning if ctx.show_thinking and completion.reasoning else None
    lps = [lp for b in completion.blocks if isinstance(b, TextBlock) for lp in b.logprobs]
    m = metrics(ctx, timing, completion.usage)
    end = timing.end_ms if timing.end_ms is not None else ctx.created_ms
    common = {
        "model": ctx.model,
        "created_at": timestamp(end),
        "done_reason": done_reason(completion.finish),
        "done": True,
        "logprobs": logprobs_out(lps) if ctx.logprobs else None,
        **{f: getattr(m, f) for f in Metrics.__struct_fields__},
    }
    if ctx.mode == "generate":
        return GenerateChunk(response=completion.text, thinking=thinking, **common)
    message = MessageOut(
        role="assistant",
        content=completion.text,
        thinking=thinking,
        tool_calls=_calls(completion.tool_calls),
    )
    return ChatChunk(message=message, **common)
