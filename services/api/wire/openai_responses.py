"""OpenAI Responses projection: inference events → ``/v1/responses`` SSE frames and objects.

Owns the streaming projector (a small, pure state object: no awaits, no Redis, no clock, no
random ids) and ``render``, which builds the non-streaming ``Response`` from
``shared.accumulate.fold`` over the same events, so both paths agree by construction. Item ids
derive from the response id and the output index, so re-projecting a stored event log reproduces
the original stream byte for byte (``GET /v1/responses/{id}?stream=true``). Request parsing lives
in ``openai_responses_request``; the Structs in ``openai_responses_types``.
"""

from __future__ import annotations

from typing import Literal, assert_never

import msgspec

from services.api.sse import Frame, json_frame
from services.api.wire.openai_responses_types import (
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    Logprob,
    MessageItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    Response,
    ResponseError,
    ResponseLifecycle,
    ResponseStatus,
    ResponseUsage,
    StreamEvent,
    TopLogprob,
)
from shared.accumulate import Completion, ReasoningBlock, TextBlock, ToolCallBlock
from shared.errors import (
    ContextOverflow,
    InvalidRequest,
    Overloaded,
    ServiceError,
    WorkerLost,
)
from shared.events import (
    AnyEvent,
    Error,
    ErrorKind,
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

__all__ = ["ResponsesContext", "ResponsesProjector", "error_from_event", "item_id", "render"]

_Kind = Literal["message", "reasoning", "function_call"]
_PREFIX: dict[_Kind, str] = {"message": "msg", "reasoning": "rs", "function_call": "fc"}
# Codex and the SDK know these codes; anything else is a retryable server error to them.
_ERROR_CODES = {"context_overflow": "context_length_exceeded", "invalid_request": "invalid_prompt"}

_HTTP_ERRORS: dict[ErrorKind, type[ServiceError]] = {
    "invalid_request": InvalidRequest,
    "context_overflow": ContextOverflow,
    "overloaded": Overloaded,
    "worker_lost": WorkerLost,
    "cancelled": ServiceError,
    "internal": ServiceError,
}


def error_from_event(error: Error) -> ServiceError:
    """The HTTP error for a non-streaming request rejected before generation began.

    Args:
        error: the stream's terminal (and only) event.

    Returns:
        The ``ServiceError`` to raise (the app renders OpenAI's error body).
    """
    return _HTTP_ERRORS[error.kind](error.message)


class ResponsesContext(msgspec.Struct, frozen=True, kw_only=True):
    """What a projector needs besides events.

    Attributes:
        skeleton: the in-progress ``Response`` echoing the request (id, created_at, params).
        starting_after: replay only the events after this ``sequence_number`` (-1: all).
    """

    skeleton: Response
    starting_after: int = -1


def item_id(response_id: str, kind: _Kind, output_index: int) -> str:
    """The deterministic id of an output item.

    Args:
        response_id: ``resp_...``.
        kind: the item type.
        output_index: the item's position in ``output``.

    Returns:
        e.g. ``msg_<response suffix>_0``.
    """
    return f"{_PREFIX[kind]}_{response_id.removeprefix('resp_')}_{output_index}"


def _call_id(call_id: str) -> str:
    # Clients key tool results on call ids of the form call_...; keep ours recognisable.
    return call_id if call_id.startswith("call_") else f"call_{call_id}"


def _logprobs(entries: list[TokenLogprob] | None) -> list[Logprob]:
    return [
        Logprob(
            token=e.token,
            bytes=e.bytes if e.bytes is not None else list(e.token.encode()),
            logprob=e.logprob,
            top_logprobs=[
                TopLogprob(
                    token=t.token,
                    bytes=t.bytes if t.bytes is not None else list(t.token.encode()),
                    logprob=t.logprob,
                )
                for t in e.top
            ],
        )
        for e in entries or []
    ]


def _usage(usage: Usage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    return ResponseUsage(
        input_tokens=usage.input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
        total_tokens=usage.input_tokens + usage.output_tokens,
    )


def _terminal(finish: Finish | None, error: Error | None) -> tuple[ResponseStatus, str]:
    """The response status and the lifecycle event type that announces it."""
    if error is not None:
        return "failed", "response.failed"
    if finish is None:
        return "in_progress", "response.in_progress"
    if finish.reason == "max_tokens":
        return "incomplete", "response.incomplete"
    if finish.reason == "cancelled":
        # The SDK has no response.cancelled event; incomplete is the closest non-success end.
        return "cancelled", "response.incomplete"
    return "completed", "response.completed"


def _final(
    skeleton: Response,
    output: list[OutputItem],
    usage: Usage | None,
    finish: Finish | None,
    error: Error | None,
) -> Response:
    status, _ = _terminal(finish, error)
    incomplete = finish is not None and finish.reason == "max_tokens"
    return msgspec.structs.replace(
        skeleton,
        status=status,
        output=output,
        usage=_usage(usage),
        error=None
        if error is None
        else ResponseError(
            code=_ERROR_CODES.get(error.kind, "server_error"), message=error.message
        ),
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
    )


def _build_item(
    kind: _Kind,
    iid: str,
    status: ItemStatus,
    text: str,
    logprobs: list[Logprob],
    call: ToolCallStart | None,
) -> OutputItem:
    if kind == "message":
        return MessageItem(
            id=iid, status=status, content=[OutputText(text=text, logprobs=logprobs)]
        )
    if kind == "reasoning":
        return ReasoningItem(id=iid, status=status, content=[ReasoningText(text=text)])
    assert call is not None
    return FunctionCallItem(
        id=iid, status=status, arguments=text, call_id=_call_id(call.call_id), name=call.name
    )


def render(completion: Completion, skeleton: Response) -> Response:
    """Build the non-streaming response (also what GET returns) from folded events.

    Args:
        completion: ``fold(events)``; may be partial (still generating).
        skeleton: the request echo from ``openai_responses_request.skeleton``.

    Returns:
        The response; the last item is ``incomplete`` when generation did not end naturally,
        ``in_progress`` while it has not ended.
    """
    status, _ = _terminal(completion.finish, completion.error)
    output: list[OutputItem] = []
    for index, block in enumerate(completion.blocks):
        last = index == len(completion.blocks) - 1
        item_status: ItemStatus = "completed"
        if last and status == "in_progress":
            item_status = "in_progress"
        elif last and status != "completed":
            item_status = "incomplete"
        match block:
            case TextBlock():
                iid = item_id(skeleton.id, "message", index)
                logprobs = _logprobs(block.logprobs)
                output.append(_build_item("message", iid, item_status, block.text, logprobs, None))
            case ReasoningBlock():
                iid = item_id(skeleton.id, "reasoning", index)
                output.append(_build_item("reasoning", iid, item_status, block.text, [], None))
            case ToolCallBlock():
                iid = item_id(skeleton.id, "function_call", index)
                call = ToolCallStart(index=block.index, call_id=block.call_id, name=block.name)
                output.append(
                    _build_item("function_call", iid, item_status, block.arguments, [], call)
                )
            case _:
                assert_never(block)
    return _final(skeleton, output, completion.usage, completion.finish, completion.error)


class _OpenItem:
    """The item being streamed; it stays open until an event of another kind (or the end)."""

    def __init__(self, kind: _Kind, iid: str, index: int, call: ToolCallStart | None) -> None:
        self.kind, self.id, self.index, self.call = kind, iid, index, call
        self.text = ""
        self.logprobs: list[Logprob] = []
        self.accepting = True  # False after ReasoningEnd / ToolCallEnd: the next delta is new


class ResponsesProjector:
    """Projects one response's events into Responses SSE frames.

    Lifecycle: ``response.created`` and ``response.in_progress`` before anything else; each item
    added → deltas → done before the next; one terminal lifecycle event with every final item.
    """

    def __init__(self, ctx: ResponsesContext) -> None:
        """Create a projector.

        Args:
            ctx: the response skeleton and the replay offset.
        """
        self._ctx = ctx
        self._seq = 0
        self._started = False
        self._ended = False
        self._items: list[OutputItem] = []
        self._open: _OpenItem | None = None
        self._usage: Usage | None = None

    def feed(self, event: AnyEvent) -> list[Frame]:
        """Project one event.

        Args:
            event: the next event of the request's stream.

        Returns:
            The frames to send (those at or before ``starting_after`` are withheld).
        """
        out: list[StreamEvent] = []
        if self._ended:
            return []
        if not self._started:
            self._started = True
            out.append(self._lifecycle("response.created", self._ctx.skeleton))
            out.append(self._lifecycle("response.in_progress", self._ctx.skeleton))
        self._dispatch(event, out)
        return self._frames(out)

    def close(self) -> list[Frame]:
        """Nothing follows the terminal event: the connection simply closes (Codex needs EOF).

        Returns:
            No frames.
        """
        return []

    def _dispatch(self, event: AnyEvent, out: list[StreamEvent]) -> None:
        match event:
            case Start():
                pass
            case TextDelta():
                item = self._ensure(out, "message", None)
                item.text += event.text
                logprobs = _logprobs(event.logprobs)
                item.logprobs.extend(logprobs)
                out.append(OutputTextDelta(item.id, item.index, 0, event.text, logprobs, self._n()))
            case ReasoningDelta():
                item = self._ensure(out, "reasoning", None)
                item.text += event.text
                out.append(ReasoningTextDelta(item.id, item.index, 0, event.text, self._n()))
            case ReasoningEnd():
                self._stop_accepting("reasoning", None)
            case ToolCallStart():
                self._ensure(out, "function_call", event)
            case ToolCallArgsDelta():
                call = self._open
                if call is not None and call.kind == "function_call":
                    call.text += event.fragment
                    delta = FunctionCallArgumentsDelta(
                        call.id, call.index, event.fragment, self._n()
                    )
                    out.append(delta)
            case ToolCallEnd():
                self._stop_accepting("function_call", event.arguments)
            case Usage():
                self._usage = event
            case Finish():
                self._end(out, event, None)
            case Error():
                self._end(out, None, event)
            case _:
                assert_never(event)

    def _stop_accepting(self, kind: _Kind, final_text: str | None) -> None:
        """The open item of ``kind`` is complete; the next delta of that kind opens a new one."""
        item = self._open
        if item is not None and item.kind == kind:
            item.accepting = False
            if final_text is not None:
                item.text = final_text

    def _n(self) -> int:
        n = self._seq
        self._seq += 1
        return n

    def _lifecycle(self, kind: str, response: Response) -> ResponseLifecycle:
        return ResponseLifecycle(type=kind, response=response, sequence_number=self._n())

    def _ensure(self, out: list[StreamEvent], kind: _Kind, call: ToolCallStart | None) -> _OpenItem:
        """Return the open item of ``kind``, closing the current one and opening a new one."""
        item = self._open
        if item is not None and item.kind == kind and item.accepting and call is None:
            return item
        self._close_item(out, "completed")
        index = len(self._items)
        item = _OpenItem(kind, item_id(self._ctx.skeleton.id, kind, index), index, call)
        self._open = item
        if kind == "function_call":
            added = _build_item(kind, item.id, "in_progress", "", [], call)
        elif kind == "message":
            added = MessageItem(id=item.id, status="in_progress")
        else:
            added = ReasoningItem(id=item.id, status="in_progress")
        out.append(OutputItemAdded(index, added, self._n()))
        if kind != "function_call":
            part = OutputText() if kind == "message" else ReasoningText()
            out.append(ContentPartAdded(item.id, index, 0, part, self._n()))
        return item

    def _close_item(self, out: list[StreamEvent], status: ItemStatus) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        final = _build_item(item.kind, item.id, status, item.text, item.logprobs, item.call)
        n = self._n
        if item.kind == "message":
            part: OutputText | ReasoningText = OutputText(text=item.text, logprobs=item.logprobs)
            out.append(OutputTextDone(item.id, item.index, 0, item.text, item.logprobs, n()))
            out.append(ContentPartDone(item.id, item.index, 0, part, n()))
        elif item.kind == "reasoning":
            part = ReasoningText(text=item.text)
            out.append(ReasoningTextDone(item.id, item.index, 0, item.text, n()))
            out.append(ContentPartDone(item.id, item.index, 0, part, n()))
        else:
            assert item.call is not None
            out.append(
                FunctionCallArgumentsDone(item.id, item.index, item.call.name, item.text, n())
            )
        out.append(OutputItemDone(item.index, final, n()))
        self._items.append(final)

    def _end(self, out: list[StreamEvent], finish: Finish | None, error: Error | None) -> None:
        self._ended = True
        status, kind = _terminal(finish, error)
        self._close_item(out, "completed" if status == "completed" else "incomplete")
        final = _final(self._ctx.skeleton, list(self._items), self._usage, finish, error)
        if error is not None and final.error is not None:
            out.append(ErrorEvent(final.error.code, error.message, None, self._n()))
        out.append(self._lifecycle(kind, final))

    def _frames(self, events: list[StreamEvent]) -> list[Frame]:
        after = self._ctx.starting_after
        return [json_frame(e, event=_type(e)) for e in events if e.sequence_number > after]


def _type(event: StreamEvent) -> str:
    if isinstance(event, ResponseLifecycle):
        return event.type
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag
