"""OpenAI Chat Completions output: the streaming projector and the non-streaming render.

Owns the event -> ``chat.completion.chunk`` mapping (wire-formats.md §2.5, §8.1) and the
``chat.completion`` body, which is ``render(fold(events))`` so both paths read the same events.
Pure: no awaits, no Redis, no clock, no random ids; everything variable comes from ``ChatContext``.
Request parsing lives in ``openai_chat_request``; the response Structs in ``openai_chat_types``.
"""

from __future__ import annotations

from typing import assert_never

import msgspec
from msgspec import UNSET

from services.api.errors import openai_error_body
from services.api.wire.common import service_error
from services.api.wire.openai_chat.types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatFinishReason,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionTokensDetails,
    CompletionUsage,
    Delta,
    FunctionDelta,
    FunctionOut,
    LogprobOut,
    PromptTokensDetails,
    ReasoningField,
    ResponseMessage,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobOut,
)
from services.api.wire.sse import Frame, json_frame
from shared.accumulate import Completion, TextBlock
from shared.errors import ServiceError
from shared.events import (
    AnyEvent,
    Error,
    Finish,
    FinishReason,
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

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatContext",
    "ChatProjector",
    "ReasoningField",
    "error_from_event",
    "render",
]


_FINISH: dict[FinishReason, ChatFinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "cancelled": "stop",  # the wire has no "cancelled"; only replays of cut requests see it
}


class ChatContext(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a chat projector needs besides the events."""

    id: str  # "chatcmpl-…", the same on every chunk
    created: int  # unix seconds, the same on every chunk
    model: str
    include_usage: bool = False
    include_reasoning: bool = False
    reasoning_field: ReasoningField = "reasoning_content"
    logprobs: bool = False


_ENCODER = msgspec.json.Encoder()
_DONE = Frame(data=b"[DONE]")


def _usage(usage: Usage | None) -> CompletionUsage:
    u = usage or Usage(input_tokens=0, output_tokens=0)
    return CompletionUsage(
        prompt_tokens=u.input_tokens,
        completion_tokens=u.output_tokens,
        total_tokens=u.input_tokens + u.output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=u.reasoning_tokens),
    )


def _logprobs(items: list[TokenLogprob]) -> ChoiceLogprobs:
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


def _finish_reason(finish: Finish | None, had_tool_calls: bool) -> ChatFinishReason:
    reason = _FINISH[finish.reason] if finish is not None else "stop"
    # A model that ends its turn naturally after calling tools is asking for their results.
    return "tool_calls" if had_tool_calls and reason == "stop" else reason


def _reasoning_delta(text: str, field: ReasoningField) -> Delta:
    return Delta(
        reasoning_content=text if field != "reasoning" else UNSET,
        reasoning=text if field != "reasoning_content" else UNSET,
    )


def error_from_event(error: Error) -> ServiceError:
    """Turn a terminal ``Error`` event into the exception the app renders as an HTTP error.

    Used by the non-streaming path, where nothing has been sent yet.

    Args:
        error: The stream's terminal error.

    Returns:
        A ``ServiceError`` subclass with the event's message (not raised).
    """
    return service_error(error)


class ChatProjector:
    """Projects one request's events into ``chat.completion.chunk`` frames.

    State: whether the role was sent (it rides on the first real delta only, so a client's
    time-to-first-token means a token), whether any tool call was sent (finish mapping), the
    pending ``Usage`` (sent after the finish chunk) and whether ``[DONE]`` went out.
    """

    def __init__(self, ctx: ChatContext) -> None:
        """Start a projection for the request described by ``ctx``."""
        self._ctx = ctx
        self._role_sent = False
        self._tool_calls = False
        self._usage: Usage | None = None
        self._closed = False

    def feed(self, event: AnyEvent) -> list[Frame]:
        """Project one event.

        Args:
            event: The next event of the request's stream.

        Returns:
            The SSE frames to send (possibly none).
        """
        match event:
            case Start() | ReasoningEnd() | ToolCallEnd():
                return []
            case TextDelta():
                logprobs = (
                    _logprobs(event.logprobs) if self._ctx.logprobs and event.logprobs else None
                )
                return [self._chunk(Delta(content=event.text), logprobs=logprobs)]
            case ReasoningDelta():
                if not self._ctx.include_reasoning:
                    return []
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
                return [json_frame(openai_error_body(error_from_event(event))[1])]
            case _:
                assert_never(event)

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
            self._role_sent = True
        chunk = ChatCompletionChunk(
            id=self._ctx.id,
            created=self._ctx.created,
            model=self._ctx.model,
            choices=[ChunkChoice(0, delta, logprobs, finish_reason)],
            usage=None if self._ctx.include_usage else UNSET,
        )
        return Frame(data=_ENCODER.encode(chunk))

    def _finish(self, event: Finish) -> list[Frame]:
        frames = [self._chunk(Delta(), finish_reason=_finish_reason(event, self._tool_calls))]
        if self._ctx.include_usage:
            chunk = ChatCompletionChunk(
                id=self._ctx.id,
                created=self._ctx.created,
                model=self._ctx.model,
                choices=[],
                usage=_usage(self._usage),
            )
            frames.append(Frame(data=_ENCODER.encode(chunk)))
        return frames


def render(completion: Completion, ctx: ChatContext) -> ChatCompletion:
    """Render a folded stream as the non-streaming ``chat.completion`` body.

    Args:
        completion: ``shared.accumulate.fold`` of the request's events (finished, not failed).
        ctx: The request's ids and output options.

    Returns:
        The response body; encode it with ``msgspec.json.encode``.
    """
    calls = [
        ToolCallOut(id=c.call_id, function=FunctionOut(name=c.name, arguments=c.arguments))
        for c in completion.tool_calls
    ]
    text = completion.text
    reasoning = completion.reasoning if ctx.include_reasoning else ""
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
        logprobs = _logprobs(items)
    choice = Choice(
        index=0,
        message=message,
        finish_reason=_finish_reason(completion.finish, bool(calls)),
        logprobs=logprobs,
    )
    return ChatCompletion(
        id=ctx.id,
        created=ctx.created,
        model=ctx.model,
        choices=[choice],
        usage=_usage(completion.usage),
    )
