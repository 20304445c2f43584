"""Ollama projector: inference events -> NDJSON lines, one JSON object per line.

Pure like every projector: ``created_at`` and the durations come from the request's creation
time and the entry ids the pipeline passes to ``stamp`` before each event, so a replay writes
the same bytes. Ollama's wire rules kept here: every line repeats ``model`` and ``created_at``;
text and thinking stream as fragments (``message.content``/``message.thinking`` on chat,
``response``/``thinking`` on generate); a tool call goes out whole, its arguments an object, in
one line when the call ends (Ollama parses calls before sending them, and its clients read
``arguments`` as a mapping, never as fragments); the last line has ``done: true``, the
``done_reason`` and the metrics; a failure after the headers is one ``{"error": ...}`` line,
which the official clients raise. Separator whitespace is dropped first, as ``fold`` drops it,
so the streamed text equals the non-streaming body's.

``ndjson`` tells the pipeline to frame lines, not SSE. There is no ``coalesce``: one event
gives at most one line whatever the reader's backlog, so a client that counts the lines it has
can resume after them (``Skip``).
"""

from __future__ import annotations

import msgspec

from services.api.wire.ollama.render import (
    done_reason,
    logprobs_out,
    metrics,
    timestamp,
    tool_call_out,
)
from services.api.wire.ollama.types import (
    ChatChunk,
    Context,
    ErrorLine,
    GenerateChunk,
    LogprobOut,
    MessageOut,
    Timing,
    ToolCallOut,
)
from services.api.wire.sse import Frame
from shared.events import (
    AnyEvent,
    Error,
    Finish,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from shared.separators import SeparatorGate

__all__ = ["Projector", "Skip"]

_JSON = msgspec.json.Encoder()
_EMPTY = MessageOut(role="assistant", content="")


class Projector:
    """Projects one request's events into Ollama's NDJSON lines (chat or generate)."""

    ndjson = True

    def __init__(self, ctx: Context) -> None:
        """Start a projection.

        Args:
            ctx: the endpoint, model and options of the request.
        """
        self._ctx = ctx
        self._gate = SeparatorGate()
        self._now_ms = ctx.created_ms
        self._start_ms: int | None = None
        self._usage: Usage | None = None
        self._calls: dict[int, tuple[str, str]] = {}  # index -> (call id, name)
        self._done = False

    def stamp(self, entry_id: str) -> None:
        """The entry id of the next event: its time is the line's ``created_at``."""
        self._now_ms = int(entry_id.partition("-")[0])

    def feed(self, event: AnyEvent) -> list[Frame]:
        """Project one event (separator whitespace dropped first, as ``fold`` drops it).

        Args:
            event: the next event of the stream.

        Returns:
            The lines to send (possibly none); nothing after the terminal event.
        """
        return [line for shown in self._gate.feed(event) for line in self._project(shown)]

    def close(self) -> list[Frame]:
        """Nothing after the last line: the ``done`` (or ``error``) line ends the stream."""
        return []

    def _project(self, event: AnyEvent) -> list[Frame]:
        if self._done:
            return []
        match event:
            case Start():
                if self._start_ms is None:  # a failover's second Start continues the stream
                    self._start_ms = self._now_ms
            case TextDelta() if event.text or (event.logprobs and self._ctx.logprobs):
                lps = logprobs_out(event.logprobs or []) if self._ctx.logprobs else None
                return [self._line(content=event.text, logprobs=lps)]
            case ReasoningDelta() if event.text and self._ctx.show_thinking:
                return [self._line(thinking=event.text)]
            case ToolCallStart():
                self._calls[event.index] = (event.call_id, event.name)
            case ToolCallEnd() if self._ctx.mode == "chat" and event.index in self._calls:
                call_id, name = self._calls[event.index]
                call = tool_call_out(event.index, call_id, name, event.arguments)
                return [self._line(tool_calls=[call])]
            case Usage():
                self._usage = event
            case Finish():
                self._done = True
                return [self._final(event)]
            case Error():
                self._done = True
                return [Frame(data=_JSON.encode(ErrorLine(error=event.message)))]
        return []

    def _line(
        self,
        *,
        content: str = "",
        thinking: str | None = None,
        tool_calls: list[ToolCallOut] | None = None,
        logprobs: list[LogprobOut] | None = None,
    ) -> Frame:
        created_at = timestamp(self._now_ms)
        chunk: ChatChunk | GenerateChunk
        if self._ctx.mode == "generate":
            chunk = GenerateChunk(
                model=self._ctx.model,
                created_at=created_at,
                response=content,
                thinking=thinking,
                done=False,
                logprobs=logprobs,
            )
        else:
            message = MessageOut(
                role="assistant", content=content, thinking=thinking, tool_calls=tool_calls
            )
            chunk = ChatChunk(
                model=self._ctx.model,
                created_at=created_at,
                message=message,
                done=False,
                logprobs=logprobs,
            )
        return Frame(data=_JSON.encode(chunk))

    def _final(self, finish: Finish) -> Frame:
        timing = Timing(start_ms=self._start_ms, end_ms=self._now_ms)
        m = metrics(self._ctx, timing, self._usage)
        counts = msgspec.structs.asdict(m)
        created_at = timestamp(self._now_ms)
        chunk: ChatChunk | GenerateChunk
        if self._ctx.mode == "generate":
            chunk = GenerateChunk(
                model=self._ctx.model,
                created_at=created_at,
                response="",
                done_reason=done_reason(finish),
                done=True,
                **counts,
            )
        else:
            chunk = ChatChunk(
                model=self._ctx.model,
                created_at=created_at,
                message=_EMPTY,
                done_reason=done_reason(finish),
                done=True,
                **counts,
            )
        return Frame(data=_JSON.encode(chunk))


class Skip:
    """A projector that drops the first ``lines`` lines of another: resuming an NDJSON stream.

    Lines carry no ids, so an NDJSON client resumes by how many lines it already has; the
    Ollama projection gives the same lines on every read (no coalescing), so skipping them
    continues the stream exactly.
    """

    ndjson = True

    def __init__(self, inner: Projector, lines: int) -> None:
        """Wrap ``inner``, dropping its first ``lines`` lines."""
        self._inner = inner
        self._left = lines

    def stamp(self, entry_id: str) -> None:
        """Pass the entry id on."""
        self._inner.stamp(entry_id)

    def feed(self, event: AnyEvent) -> list[Frame]:
        """The inner lines, less those the client already has."""
        return self._drop(self._inner.feed(event))

    def close(self) -> list[Frame]:
        """The inner end, less those the client already has."""
        return self._drop(self._inner.close())

    def _drop(self, lines: list[Frame]) -> list[Frame]:
        if self._left <= 0:
            return lines
        dropped, self._left = min(self._left, len(lines)), self._left - len(lines)
        return lines[dropped:]
