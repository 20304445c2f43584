"""Server-Sent Events framing: the only place that writes ``data:``/``event:``/``id:`` lines.

Projectors return ``Frame`` objects; the streaming pipeline encodes them here. Keepalives are SSE
comments (lines starting with ``:``), which every SDK decoder ignores, as the SSE specification
says (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation).
"""

from __future__ import annotations

import msgspec

__all__ = ["HEADERS", "MEDIA_TYPE", "Frame", "comment", "encode", "json_frame"]

MEDIA_TYPE = "text/event-stream; charset=utf-8"

# One copy of the streaming headers: proxies that buffer SSE (nginx without
# X-Accel-Buffering: no) are the usual cause of streams arriving all at once.
HEADERS: dict[str, str] = {
    "Content-Type": MEDIA_TYPE,
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

_JSON = msgspec.json.Encoder()


class Frame(msgspec.Struct, frozen=True):
    """One SSE event: payload, optional ``event:`` name and optional ``id:``."""

    data: bytes | str
    event: str | None = None
    id: str | None = None


def json_frame(obj: object, event: str | None = None) -> Frame:
    """Build a frame whose data is ``obj`` encoded as compact JSON.

    Args:
        obj: anything msgspec can encode (Structs, dicts, lists, scalars).
        event: the ``event:`` name, or None for a data-only frame.

    Returns:
        The frame.
    """
    return Frame(data=_JSON.encode(obj), event=event)


def _field(name: bytes, value: bytes) -> bytes:
    # A field value must not contain line breaks; SSE has no escaping, so a value with a
    # newline is split into several lines of the same field (the decoder joins them with \n).
    if b"\n" not in value and b"\r" not in value:
        return name + b": " + value + b"\n"
    lines = value.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return b"".join(name + b": " + line + b"\n" for line in lines)


# Encoded ``event:`` lines by name: a format has a handful of event names, and every frame
# carries one. Bounded, in case a caller ever names events from data.
_EVENT_LINES: dict[str, bytes] = {}
_MAX_EVENT_LINES = 256


def _event_line(name: str) -> bytes:
    line = _EVENT_LINES.get(name)
    if line is None:
        line = _field(b"event", name.encode())
        if len(_EVENT_LINES) < _MAX_EVENT_LINES:
            _EVENT_LINES[name] = line
    return line


def encode(frame: Frame, entry_id: str | None = None) -> bytes:
    """Encode one frame as the bytes of an SSE event, ending with the blank line.

    Args:
        frame: the frame to encode.
        entry_id: an ``id:`` that replaces the frame's own (the streaming pipeline stamps the
            Redis entry id on an event's last frame this way, without copying the frame).

    Returns:
        ``event:`` (if any), ``id:`` (if any) and ``data:`` lines followed by ``\\n``.
    """
    # Runs once per frame on every stream: the one-line payload (all JSON is) is the fast path.
    data = frame.data
    if isinstance(data, str):
        data = data.encode()
    if b"\n" in data or b"\r" in data:
        body = _field(b"data", data) + b"\n"
    else:
        body = b"data: " + data + b"\n\n"
    event_id = frame.id if entry_id is None else entry_id
    if event_id is not None:
        body = _id_line(event_id) + body
    if frame.event is None:
        return body
    return _event_line(frame.event) + body


def _id_line(event_id: str) -> bytes:
    if "\n" in event_id or "\r" in event_id:  # never a Redis entry id
        return _field(b"id", event_id.encode())
    return b"id: " + event_id.encode() + b"\n"


def comment(text: str = "keepalive") -> bytes:
    """Encode an SSE comment, which clients ignore; used as a keepalive.

    Args:
        text: the comment text (line breaks are replaced by spaces).

    Returns:
        ``: <text>\\n``: one line, no blank line after it. The openai SDK keeps the last
        ``id:`` across events (as the spec says) but then treats a blank line with an empty data
        buffer as an event whenever an id is set, and ``json.loads("")`` kills the stream; a
        comment that is not followed by a blank line dispatches nothing in any decoder.
    """
    flat = text.replace("\r", " ").replace("\n", " ")
    return b": " + flat.encode() + b"\n"
