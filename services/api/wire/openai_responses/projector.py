"""OpenAI Responses projector: inference events → ``/v1/responses`` SSE frames.

A small, pure state object: no awaits, no Redis, no clock, no random ids. The item builders it
shares with the non-streaming ``render`` live in ``render``. Item ids derive from the response
id and the output index, so re-projecting a stored event log reproduces the original stream
byte for byte (``GET /v1/responses/{id}?stream=true``).
"""

from __future__ import annotations

from typing import assert_never

from services.api.wire.openai_responses.call_types import (
    CustomToolCallInputDelta,
    CustomToolCallInputDone,
)
from services.api.wire.openai_responses.delta_events import (
    ReasoningSummaryPartAdded,
    ReasoningSummaryPartDone,
    ReasoningSummaryTextDelta,
    ReasoningSummaryTextDone,
    SummaryPart,
)
from services.api.wire.openai_responses.render import (
    ItemKind,
    build_item,
    call_item_id,
    entry_seconds,
    final_response,
    item_id,
    logprobs_out,
    terminal_status,
    wants_summary,
)
from services.api.wire.openai_responses.tools import Route, custom_input, routes
from services.api.wire.openai_responses.types import (
    ContentPartAdded,
    ContentPartDone,
    Context,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    ItemStatus,
    Logprob,
    MessageItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    Response,
    ResponseLifecycle,
    StreamEvent,
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

__all__ = ["Projector"]


class _OpenItem:
    """The item being streamed; it stays open until an event of another kind (or the end)."""

    def __init__(
        self,
        kind: ItemKind,
        iid: str,
        index: int,
        call: ToolCallStart | None,
        route: Route | None = None,
    ) -> None:
        self.kind, self.id, self.index, self.call, self.route = kind, iid, index, call, route
        self.text = ""
        self.logprobs: list[Logprob] = []
        self.accepting = True  # False after ReasoningEnd / ToolCallEnd: the next delta is new


class Projector:
    """Projects one response's events into Responses SSE frames.

    Lifecycle: ``response.created`` and ``response.in_progress`` before anything else; each item
    added → deltas → done before the next; one terminal lifecycle event with every final item.

    No ``coalesce`` (unlike Chat and Messages): every frame carries a ``sequence_number``, and a
    client resumes with ``starting_after`` one, so frame N must be the same event in the live
    stream and in every later projection of the log. Folding a backlog depends on timing, and
    would renumber everything after the fold.
    """

    def __init__(self, ctx: Context) -> None:
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
        self._routes = routes(ctx.skeleton.tools)
        self._gate = SeparatorGate()
        self._completed_at: int | None = None
        self._summary = wants_summary(ctx.skeleton)

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
        for shown in self._gate.feed(event):  # separator whitespace dropped, as fold drops it
            self._dispatch(shown, out)
        return self._frames(out)

    def stamp(self, entry_id: str) -> None:
        """Note the log entry id of the event about to be fed (its time is ``completed_at``).

        Args:
            entry_id: the Redis stream entry id.
        """
        self._completed_at = entry_seconds(entry_id)

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
                logprobs = logprobs_out(event.logprobs)
                item.logprobs.extend(logprobs)
                out.append(OutputTextDelta(item.id, item.index, 0, event.text, logprobs, self._n()))
            case ReasoningDelta():
                item = self._ensure(out, "reasoning", None)
                item.text += event.text
                out.append(ReasoningTextDelta(item.id, item.index, 0, event.text, self._n()))
                if self._summary:
                    summary = ReasoningSummaryTextDelta(
                        item.id, item.index, 0, event.text, self._n()
                    )
                    out.append(summary)
            case ReasoningEnd():
                self._stop_accepting("reasoning", None)
            case ToolCallStart():
                self._ensure(out, "function_call", event)
            case ToolCallArgsDelta():
                call = self._open
                if call is not None and call.kind == "function_call":
                    call.text += event.fragment
                    if call.route is not None and call.route.kind != "function":
                        return  # freeform input and search arguments arrive whole at the end
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

    def _stop_accepting(self, kind: ItemKind, final_text: str | None) -> None:
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

    def _ensure(
        self, out: list[StreamEvent], kind: ItemKind, call: ToolCallStart | None
    ) -> _OpenItem:
        """Return the open item of ``kind``, closing the current one and opening a new one."""
        item = self._open
        if item is not None and item.kind == kind and item.accepting and call is None:
            return item
        self._close_item(out, "completed")
        index = len(self._items)
        route = self._routes.get(call.name) if call is not None else None
        iid = (
            call_item_id(self._ctx.skeleton.id, route, index)
            if kind == "function_call"
            else item_id(self._ctx.skeleton.id, kind, index)
        )
        item = _OpenItem(kind, iid, index, call, route)
        self._open = item
        if kind == "function_call":
            added = build_item(kind, item.id, "in_progress", "", [], call, route)
        elif kind == "message":
            added = MessageItem(id=item.id, status="in_progress")
        else:
            added = ReasoningItem(id=item.id, status="in_progress")
        out.append(OutputItemAdded(index, added, self._n()))
        if kind == "reasoning" and self._summary:
            out.append(ReasoningSummaryPartAdded(item.id, index, 0, SummaryPart(), self._n()))
        if kind != "function_call":
            part = OutputText() if kind == "message" else ReasoningText()
            out.append(ContentPartAdded(item.id, index, 0, part, self._n()))
        return item

    def _close_item(self, out: list[StreamEvent], status: ItemStatus) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        final = build_item(
            item.kind,
            item.id,
            status,
            item.text,
            item.logprobs,
            item.call,
            item.route,
            summary=self._summary,
            signer=self._ctx.signer,
        )
        n = self._n
        if item.kind == "message":
            part: OutputText | ReasoningText = OutputText(text=item.text, logprobs=item.logprobs)
            out.append(OutputTextDone(item.id, item.index, 0, item.text, item.logprobs, n()))
            out.append(ContentPartDone(item.id, item.index, 0, part, n()))
        elif item.kind == "reasoning":
            part = ReasoningText(text=item.text)
            out.append(ReasoningTextDone(item.id, item.index, 0, item.text, n()))
            out.append(ContentPartDone(item.id, item.index, 0, part, n()))
            if self._summary:
                summary = SummaryPart(text=item.text)
                out.append(ReasoningSummaryTextDone(item.id, item.index, 0, item.text, n()))
                out.append(ReasoningSummaryPartDone(item.id, item.index, 0, summary, n()))
        elif item.route is not None and item.route.kind == "custom":
            text = custom_input(item.text)
            out.append(CustomToolCallInputDelta(item.id, item.index, text, n()))
            out.append(CustomToolCallInputDone(item.id, item.index, text, n()))
        elif item.route is None or item.route.kind == "function":
            assert item.call is not None
            name = item.route.name if item.route is not None else item.call.name
            out.append(FunctionCallArgumentsDone(item.id, item.index, name, item.text, n()))
        out.append(OutputItemDone(item.index, final, n()))
        self._items.append(final)

    def _end(self, out: list[StreamEvent], finish: Finish | None, error: Error | None) -> None:
        self._ended = True
        status, kind = terminal_status(finish, error)
        self._close_item(out, "completed" if status == "completed" else "incomplete")
        final = final_response(
            self._ctx.skeleton, list(self._items), self._usage, finish, error, self._completed_at
        )
        if error is not None and final.error is not None:
            out.append(
                ErrorEvent(final.error.code, error.message, None, self._n(), error.retryable)
            )
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
