"""OpenAI Chat Completions render: the non-streaming ``chat.completion`` from folded events.

Owns ``render``, which builds the body from ``shared.accumulate.fold(events)``, and the mappings
the streaming projector shares with it (usage, logprobs, finish reason), so the streamed and the
non-streamed answer read the same events the same way. Pure: no I/O, no clock, no random ids.
"""

from __future__ import annotations

from msgspec import UNSET

from services.api.wire.choices import merge_usage
from services.api.wire.openai_chat.types import (
    ChatCompletion,
    ChatFinishReason,
    Choice,
    ChoiceLogprobs,
    CompletionTokensDetails,
    CompletionUsage,
    Context,
    FunctionOut,
    LogprobOut,
    PromptTokensDetails,
    ResponseMessage,
    ToolCallOut,
    TopLogprobOut,
)
from shared.accumulate import Completion, ReasoningBlock, TextBlock
from shared.events import Finish, FinishReason, TokenLogprob, Usage

__all__ = ["finish_reason", "logprobs_out", "render", "render_choices", "usage_out"]

_FINISH: dict[FinishReason, ChatFinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "cancelled": "stop",  # the wire has no "cancelled"; only replays of cut requests see it
}


def usage_out(usage: Usage | None) -> CompletionUsage:
    """The wire usage of a stream's ``Usage`` (zeros when there was none).

    Args:
        usage: the stream's usage event, if any.

    Returns:
        The ``usage`` object of the body or of the final chunk.
    """
    u = usage or Usage(input_tokens=0, output_tokens=0)
    return CompletionUsage(
        prompt_tokens=u.input_tokens,
        completion_tokens=u.output_tokens,
        total_tokens=u.input_tokens + u.output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=u.reasoning_tokens),
    )


def logprobs_out(items: list[TokenLogprob]) -> ChoiceLogprobs:
    """Token logprobs in the ``choices[].logprobs`` shape.

    Args:
        items: the events' logprobs, in order.

    Returns:
        One ``LogprobOut`` per token.
    """
    return ChoiceLogprobs(
        content=[
            LogprobOut(
                token=lp.token,
                logprob=lp.logprob,
                bytes=lp.bytes,
                top_logprobs=[TopLogprobOut(t.token, t.logprob, t.bytes) for t in lp.top],
            )
            for lp in items
        ]
    )


def finish_reason(finish: Finish | None, had_tool_calls: bool) -> ChatFinishReason:
    """The wire ``finish_reason`` of a stream's ``Finish``.

    Args:
        finish: the stream's finish event, if any.
        had_tool_calls: whether the turn called any tool.

    Returns:
        ``stop``, ``length`` or ``tool_calls``.
    """
    reason = _FINISH[finish.reason] if finish is not None else "stop"
    # A model that ends its turn naturally after calling tools is asking for their results.
    return "tool_calls" if had_tool_calls and reason == "stop" else reason


def render(completion: Completion, ctx: Context) -> ChatCompletion:
    """Render a folded stream as the non-streaming ``chat.completion`` body.

    Args:
        completion: ``shared.accumulate.fold`` of the request's events (finished, not failed).
        ctx: The request's ids and output options.

    Returns:
        The response body; encode it with ``msgspec.json.encode``.
    """
    return render_choices([completion], ctx)


def render_choices(completions: list[Completion], ctx: Context) -> ChatCompletion:
    """Render the folded streams of a request's choices as one ``chat.completion`` body.

    Args:
        completions: the fold of each choice's events, choice 0 first (finished, not failed).
        ctx: The request's ids and output options.

    Returns:
        The response body: ``choices[i]`` from ``completions[i]``, usage summed over the
        choices with the prompt counted once (``wire.choices.merge_usage``).
    """
    return ChatCompletion(
        id=ctx.id,
        created=ctx.created,
        model=ctx.model,
        choices=[_choice(c, ctx, i) for i, c in enumerate(completions)],
        usage=usage_out(merge_usage([c.usage for c in completions])),
    )


def _inline(completion: Completion, markers: tuple[str, str]) -> str:
    """The content with each reasoning block between the model's markers, in stream order (a
    block cut short, e.g. by ``max_tokens``, has no close marker, as the model wrote it)."""
    open_, close = markers
    parts = [
        f"{open_}{b.text}{close if b.closed else ''}" if isinstance(b, ReasoningBlock) else b.text
        for b in completion.blocks
        if isinstance(b, ReasoningBlock | TextBlock)
    ]
    return "".join(parts)


def _choice(completion: Completion, ctx: Context, index: int) -> Choice:
    calls = [
        ToolCallOut(id=c.call_id, function=FunctionOut(name=c.name, arguments=c.arguments))
        for c in completion.tool_calls
    ]
    text = completion.text
    reasoning = completion.reasoning if ctx.include_reasoning else ""
    if ctx.reasoning_markers is not None and reasoning:
        text, reasoning = _inline(completion, ctx.reasoning_markers), ""
    field = ctx.reasoning_field
    message = ResponseMessage(
        # content is null (not "") when the turn is only tool calls, as OpenAI sends it
        content=text if text or not calls else None,
        tool_calls=calls or UNSET,
        reasoning_content=reasoning if reasoning and field != "reasoning" else UNSET,
        reasoning=reasoning if reasoning and field != "reasoning_content" else UNSET,
    )
    logprobs = None
    if ctx.logprobs:
        items = [lp for b in completion.blocks if isinstance(b, TextBlock) for lp in b.logprobs]
        logprobs = logprobs_out(items)
    return Choice(
        index=index,
        message=message,
        finish_reason=finish_reason(completion.finish, bool(calls)),
        logprobs=logprobs,
    )
