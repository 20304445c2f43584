"""SSE framing: byte-exact frames, multi-line data, comments, and what a parser reads back."""

from __future__ import annotations

import pytest

from services.api.wire import sse


def parse(raw: bytes) -> list[dict[str, str]]:
    """A minimal WHATWG event-stream parser (what the SDK decoders implement)."""
    events: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    for line in raw.decode().split("\n"):
        if line.startswith(":"):
            continue
        if not line:
            if fields:
                events.append(fields)
            fields = {}
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        fields[name] = f"{fields[name]}\n{value}" if name in fields else value
    return events


def test_data_only_frame() -> None:
    assert sse.encode(sse.Frame(data=b'{"a":1}')) == b'data: {"a":1}\n\n'


def test_named_frame_with_id() -> None:
    frame = sse.Frame(data="x", event="message_start", id="1700000000000-3")
    assert sse.encode(frame) == b"event: message_start\nid: 1700000000000-3\ndata: x\n\n"


def test_entry_id_stamped_while_encoding() -> None:
    # the pipeline puts the Redis entry id on an event's last frame without copying the frame
    frame = sse.Frame(data="a\nb", event="e", id="1-0")
    assert (
        sse.encode(frame, "1700000000000-4")
        == b"event: e\nid: 1700000000000-4\ndata: a\ndata: b\n\n"
    )
    assert sse.encode(sse.Frame(data=b"{}"), "9-9") == b"id: 9-9\ndata: {}\n\n"
    assert sse.encode(frame) == b"event: e\nid: 1-0\ndata: a\ndata: b\n\n"


def test_json_frame_is_compact_json() -> None:
    frame = sse.json_frame({"type": "ping", "n": [1, 2]}, event="ping")
    assert frame == sse.Frame(data=b'{"type":"ping","n":[1,2]}', event="ping")


@pytest.mark.parametrize("text", ["a\nb", "a\r\nb", "a\rb", "\nlead", "trail\n", "x\n\ny"])
def test_line_breaks_split_into_data_lines(text: str) -> None:
    raw = sse.encode(sse.Frame(data=text, event="e"))
    assert raw.endswith(b"\n\n")
    normalized = text.replace("\r\n", "\n").replace("\r", "\n")
    assert parse(raw) == [{"event": "e", "data": normalized}]


def test_comment_is_ignored_by_parsers() -> None:
    # one line and no blank line: a blank line after an id'd event would dispatch an empty
    # event in the openai SDK's decoder
    assert sse.comment() == b": keepalive\n"
    assert sse.comment("a\nb") == b": a b\n"
    frame = sse.encode(sse.Frame(data="1", id="5-0"))
    assert parse(frame + sse.comment() + frame) == [{"id": "5-0", "data": "1"}] * 2


def test_headers_disable_buffering() -> None:
    assert sse.HEADERS["Cache-Control"] == "no-cache"
    assert sse.HEADERS["X-Accel-Buffering"] == "no"
    assert sse.HEADERS["Content-Type"].startswith("text/event-stream")
