"""OpenAI legacy Completions render: the non-streaming ``text_completion`` from folded events.

Owns ``render`` and the mappings the streaming projector shares with it (finish reason, the
legacy logprobs lists), so a streamed and a non-streamed answer read the same events the same
way. ``text_offset`` counts each token's own text from the start of the choice's text (after
an echoed prompt), in both paths alike. Pure: no I/O, no clock, no random ids.
"""

from __future__ import annotations

from services.api.wire.choices import merge_usage
from services.api.wire.openai_chat.render import usage_out
from services.api.wire.openai_completions.types import (
    CompletionChoice,
    CompletionFinishReason,
    Context,
    Logprobs,
    TextCompletion,
)
from shared.accumulate import Completion, TextBlock
from shared.events import Finish, TokenLogprob

__all__ = ["echo_logprobs", "finish_reason", "logprobs_out", "render", "render_choices"]


def finish_reason(finish: Finish | None) -> CompletionFinishReason:
    """``length`` when ``max_tokens`` cut the text, else ``stop`` (the wire has no other).

    Args:
        finish: the stream's finish event, if any.

    Returns:
        The wire ``finish_reason``.
    """
    return "length" if finish is not None and finish.reason == "max_tokens" else "stop"


def logprobs_out(items: list[TokenLogprob], offset: int) -> Logprobs:
    """Sampled tokens' logprobs in the legacy shape.

    Args:
        items: the events' logprobs, in order.
        offset: the character offset of the first token in the choice's text.

    Returns:
        The parallel lists; ``top_logprobs`` maps each alternative's text to its logprob.
    """
    out = Logprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for lp in items:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({t.token: t.logprob for t in lp.top})
        out.text_offset.append(offset)
        offset += len(lp.token)
    return out


def echo_logprobs(tokens: list[str]) -> Logprobs:
    """The echoed prompt's entries: its tokens with null scores (see ``types.Logprobs``).

    Args:
        tokens: the prompt's tokens' texts.

    Returns:
        The parallel lists, offsets from 0.
    """
    offsets, pos = [], 0
    for token in tokens:
        offsets.append(pos)
        pos += len(token)
    nulls: list[float | None] = [None] * len(tokens)
    return Logprobs(
        tokens=list(tokens),
        token_logprobs=nulls,
        top_logprobs=[None] * len(tokens),
        text_offset=offsets,
    )


def _joined(head: Logprobs, tail: Logprobs) -> Logprobs:
    return Logprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )


def render(completion: Completion, ctx: Context) -> TextCompletion:
    """Render a folded stream as the non-streaming ``text_completion`` body.

    Args:
        completion: ``shared.accumulate.fold`` of the request's events (finished, not failed).
        ctx: the request's ids and output options.

    Returns:
        The response body; encode it with ``msgspec.json.encode``.
    """
    return render_choices([completion], [ctx])


def render_choices(completions: list[Completion], contexts: list[Context]) -> TextCompletion:
    """Render the folded streams of a request's choices as one ``text_completion`` body.

    Args:
        completions: the fold of each choice's events, choice 0 first (finished, not failed).
        contexts: each choice's context (the request's ids and output options, and the echo
            of the choice's own prompt in a batch).

    Returns:
        The response body: ``choices[i]`` from ``completions[i]`` (each with its echo, when
        asked for), usage summed over the choices with each prompt counted once.
    """
    ctx = contexts[0]
    usages = [c.usage for c in completions]
    return TextCompletion(
        id=ctx.id,
        created=ctx.created,
        model=ctx.model,
        choices=[
            _choice(c, x, i) for i, (c, x) in enumerate(zip(completions, contexts, strict=True))
        ],
        usage=usage_out(merge_usage(usages, ctx.prompts)),
    )


def _choice(completion: Completion, ctx: Context, index: int) -> CompletionChoice:
    echo = ctx.echo or ""
    logprobs = None
    if ctx.logprobs:
        items = [lp for b in completion.blocks if isinstance(b, TextBlock) for lp in b.logprobs]
        sampled = logprobs_out(items, len(echo))
        logprobs = _joined(echo_logprobs(ctx.echo_tokens), sampled) if ctx.echo else sampled
    return CompletionChoice(
        index=index,
        text=echo + completion.text,
        logprobs=logprobs,
        finish_reason=finish_reason(completion.finish),
    )
