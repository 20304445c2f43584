"""OpenAI legacy Completions projector: inference events -> ``text_completion`` chunks.

One ``data:`` chunk per text delta (``choices[0].text``), the echoed prompt first when asked
for, a last chunk with empty text and the ``finish_reason``, the usage chunk (``choices: []``)
when the client asked for it, and ``data: [DONE]``. A failure after the headers is one chunk
with OpenAI's error envelope, which the SDK raises as ``APIError``. The job is ``raw_text``,
so the worker sends only text deltas; anything else is skipped. Pure: no awaits, no Redis,
no clock; everything variable comes from ``Context``.
"""

from __future__ import annotations

import msgspec

from services.api.wire import openai_errors
from services.api.wire.common import service_error
from services.api.wire.openai_chat.render import usage_out
from services.api.wire.openai_completions.render import (
    echo_logprobs,
    finish_reason,
    logprobs_out,
)
from services.api.wire.openai_completions.types import (
    CompletionChoice,
    CompletionFinishReason,
    Context,
    Logprobs,
    TextCompletion,
)
from services.api.wire.sse import Frame, json_frame
from shared.events import AnyEvent, Error, Finish, Start, TextDelta, Usage

__all__ = ["Projector", "usage_chunk"]

_ENCODER = msgspec.json.Encoder()
_DONE = Frame(data=b"[DONE]")


class Projector:
    """Projects one request's events into ``text_completion`` chunks.

    State: the character offset of the next token (``text_offset`` runs on across chunks),
    whether the echo went out, the pending ``Usage`` and whether ``[DONE]`` went out.

    ``coalesce``: a backlog's text deltas may be joined (``services.api.coalesce``); a joined
    delta is a longer ``text`` with its logprobs concatenated, and the offsets still run on.
    """

    coalesce = True

    def __init__(self, ctx: Context) -> None:
        """Start a projection for the request described by ``ctx``."""
        self._ctx = ctx
        self._offset = 0
        self._echoed = ctx.echo is None
        self._usage: Usage | None = None
        self._closed = False

    def feed(self, event: AnyEvent) -> list[Frame]:
        """Project one event.

        Args:
            event: the next event of the stream.

        Returns:
            The SSE frames to send (possibly none).
        """
        match event:
            case Start():
                return self._echo()
            case TextDelta():
                frames = self._echo()
                logprobs = None
                if self._ctx.logprobs:
                    logprobs = logprobs_out(event.logprobs or [], self._offset)
                    self._offset += sum(len(lp.token) for lp in event.logprobs or [])
                return [*frames, self._chunk(event.text, logprobs)]
            case Usage():
                self._usage = event
                return []
            case Finish():
                return [*self._echo(), *self._finish(event)]
            case Error():
                # The same envelope as an HTTP error; the SDK raises APIError on it.
                return [json_frame(openai_errors.error_body(service_error(event))[1])]
            case _:
                return []  # a raw-text job has no reasoning or tool-call events

    def close(self) -> list[Frame]:
        """End the stream with ``data: [DONE]`` (once)."""
        if self._closed:
            return []
        self._closed = True
        return [_DONE]

    def _echo(self) -> list[Frame]:
        """The echoed prompt, once, before any generated text."""
        if self._echoed:
            return []
        self._echoed = True
        text = self._ctx.echo or ""
        self._offset = len(text)
        logprobs = echo_logprobs(self._ctx.echo_tokens) if self._ctx.logprobs else None
        return [self._chunk(text, logprobs)]

    def _chunk(
        self,
        text: str,
        logprobs: Logprobs | None = None,
        reason: CompletionFinishReason | None = None,
    ) -> Frame:
        chunk = TextCompletion(
            id=self._ctx.id,
            created=self._ctx.created,
            model=self._ctx.model,
            choices=[CompletionChoice(self._ctx.index, text, logprobs, reason)],
            usage=None if self._ctx.include_usage else msgspec.UNSET,
        )
        return Frame(data=_ENCODER.encode(chunk))

    def _finish(self, event: Finish) -> list[Frame]:
        frames = [self._chunk("", reason=finish_reason(event))]
        if self._ctx.n == 1:  # with n > 1, one usage chunk for all choices, after the last
            frames += usage_chunk(self._ctx, self._usage)
        return frames


def usage_chunk(ctx: Context, usage: Usage | None) -> list[Frame]:
    """The usage chunk (``choices: []``) when the client asked for usage, else nothing.

    Args:
        ctx: the request's context.
        usage: the request's usage (summed over the choices with ``n`` > 1).

    Returns:
        The frames to send after the last finish chunk.
    """
    if not ctx.include_usage:
        return []
    chunk = TextCompletion(
        id=ctx.id, created=ctx.created, model=ctx.model, choices=[], usage=usage_out(usage)
    )
    return [Frame(data=_ENCODER.encode(chunk))]
