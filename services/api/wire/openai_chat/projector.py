"""OpenAI Chat Completions projector: inference events -> ``chat.completion.chunk`` frames.

Owns the streaming mapping: one ``data:`` chunk per delta, the role on the first real delta
only, tool calls as indexed deltas, a finish chunk, the usage chunk (``choices: []``) when the
client asked for it, and ``data: [DONE]`` last. A failure after the headers is one chunk
carrying OpenAI's error envelope, which the SDK raises as ``APIError``. Pure: no awaits, no
Redis, no clock, no random ids; everything variable comes from ``Context``.
"""

from __future__ import annotations

from typing import assert_never

import msgspec
from msgspec import UNSET

from services.api.wire import openai_errors
from services.api.wire.common import service_error
from services.api.wire.openai_chat.render import finish_reason, logprobs_out, usage_out
from services.api.wire.openai_chat.types import (
    ChatCompletionChunk,
    ChatFinishReason,
    ChoiceLogprobs,
    ChunkChoice,
    Context,
    Delta,
    FunctionDelta,
    ReasoningField,
    ToolCallDelta,
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

__all__ = ["Projector", "usage_chunk"]

_ENCODER = msgspec.json.Encoder()
_DONE = Frame(data=b"[DONE]")


def _reasoning_delta(text: str, field: ReasoningField) -> Delta:
    return Delta(
        reasoning_content=text if field != "reasoning" else UNSET,
        reasoning=text if field != "reasoning_content" else UNSET,
    )


class Projector:
    """Projects one request's events into ``chat.completion.chunk`` frames.

    State: whether the role was sent (it rides on the first real delta only, so a client's
    time-to-first-token means a token), whether any tool call was sent (finish mapping), the
    pending ``Usage`` (sent after the finish chunk) and whether ``[DONE]`` went out.

    ``coalesce``: a reader's backlog of deltas may be folded into fewer chunks
    (``services.api.coalesce``): chunks carry no position of their own, so a joined delta is
    just a longer ``content``, and resuming is by entry id.
    """

    coalesce = True

    def __init__(self, ctx: Context) -> None:
        """Start a projection for the request described by ``ctx``."""
        self._gate = SeparatorGate()
        self._ctx = ctx
        self._role_sent = False
        self._tool_calls = False
        self._usage: Usage | None = None
        self._closed = False
        self._inline_open = False  # an inline reasoning block's open marker went out

    def feed(self, event: AnyEvent) -> list[Frame]:
        """Project one event (separator whitespace dropped first, as ``fold`` drops it).

        Args:
            event: the next event of the stream.

        Returns:
            The SSE frames to send (possibly none).
        """
        return [frame for shown in self._gate.feed(event) for frame in self._project(shown)]

    def _project(self, event: AnyEvent) -> list[Frame]:
        """Project one event.

        Args:
            event: The next event of the request's stream.

        Returns:
            The SSE frames to send (possibly none).
        """
        match event:
            case ReasoningEnd() if self._inline_open and self._ctx.reasoning_markers:
                self._inline_open = False
                return [self._chunk(Delta(content=self._ctx.reasoning_markers[1]))]
            case Start() | ReasoningEnd() | ToolCallEnd():
                return []
            case TextDelta():
                logprobs = (
                    logprobs_out(event.logprobs) if self._ctx.logprobs and event.logprobs else None
                )
                return [self._chunk(Delta(content=event.text), logprobs=logprobs)]
            case ReasoningDelta():
                if not self._ctx.include_reasoning:
                    return []
                if (markers := self._ctx.reasoning_markers) is not None:
                    opening = "" if self._inline_open else markers[0]
                    self._inline_open = True
                    return [self._chunk(Delta(content=opening + event.text))]
                return [self._chunk(_reasoning_delta(event.text, self._ctx.reasoning_field))]
            case ToolCallStart():
                self._tool_calls = True
                call = ToolCallDelta(
                    index=event.index,
                    id=event.call_id,
                    type="function",
                    function=FunctionDelta(name=event.name, arguments=""),
                )
                return [self._chunk(Delta(tool_calls=[call]))]
            case ToolCallArgsDelta():
                call = ToolCallDelta(
                    index=event.index, function=FunctionDelta(arguments=event.fragment)
                )
                return [self._chunk(Delta(tool_calls=[call]))]
            case Usage():
                self._usage = event
                return []
            case Finish():
                return self._finish(event)
            case Error():
                # The same envelope as an HTTP error; the SDK raises APIError on it.
                return [json_frame(openai_errors.error_body(service_error(event))[1])]
            case _:
                assert_never(event)

    def open(self) -> list[Frame]:
        """The choice's first chunk (role, empty content) unless one went out already.

        With ``n`` > 1 a choice can have nothing to show yet (hidden reasoning) while a later
        one streams; the openai SDK's stream accumulator numbers choices by first appearance,
        so the merge opens the earlier ones first, as OpenAI's own streams do.

        Returns:
            The opening chunk, or nothing.
        """
        # content null, not "": the choice may turn out to be tool calls only (content null)
        return [] if self._role_sent else [self._chunk(Delta(content=None))]

    def close(self) -> list[Frame]:
        """End the stream with ``data: [DONE]`` (once)."""
        if self._closed:
            return []
        self._closed = True
        return [_DONE]

    def _chunk(
        self,
        delta: Delta,
        *,
        logprobs: ChoiceLogprobs | None = None,
        finish_reason: ChatFinishReason | None = None,
    ) -> Frame:
        if not self._role_sent:
            # The SDK concatenates every string field of a delta, so role goes out exactly once.
            delta.role = "assistant"
            if delta.content is UNSET:
                only_role = delta.reasoning_content is UNSET and delta.reasoning is UNSET
                delta.content = "" if only_role and delta.tool_calls is UNSET else None
            delta.refusal = None  # OpenAI's first chunk says "no refusal"; strict parsers read it
            self._role_sent = True
        chunk = ChatCompletionChunk(
            id=self._ctx.id,
            created=self._ctx.created,
            model=self._ctx.model,
            choices=[ChunkChoice(self._ctx.index, delta, logprobs, finish_reason)],
            usage=None if self._ctx.include_usage else UNSET,
        )
        return Frame(data=_ENCODER.encode(chunk))

    def _finish(self, event: Finish) -> list[Frame]:
        frames = [self._chunk(Delta(), finish_reason=finish_reason(event, self._tool_calls))]
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
    chunk = ChatCompletionChunk(
        id=ctx.id, created=ctx.created, model=ctx.model, choices=[], usage=usage_out(usage)
    )
    return [Frame(data=_ENCODER.encode(chunk))]
