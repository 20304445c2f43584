"""A strict Anthropic stream consumer, as demanding as Claude Code.

``parse_sse`` splits raw SSE bytes into ``(event name, data)`` pairs; ``strict_consume`` checks
the lifecycle rules the SDK forgives but Claude Code does not (one ``message_start``; blocks
started at the next dense index, never overlapping, never reused; every delta aimed at the open
block and of its type; a ``signature_delta`` closing each thinking block; tool input that parses
as a JSON object) and rebuilds the final message the way a client would.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["StreamFailed", "parse_sse", "strict_consume"]

_DELTA_BLOCK = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "signature_delta": "thinking",
    "input_json_delta": "tool_use",
}


class StreamFailed(Exception):
    """The stream ended with an ``event: error``; ``error`` is its ``error`` object."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message"))
        self.error = error


def parse_sse(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    """Split SSE bytes into events (comments skipped, multi-line data joined)."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    for chunk in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in chunk.split(b"\n"):
            if not line or line.startswith(b":"):
                continue
            field, _, value = line.partition(b":")
            text = value.decode().removeprefix(" ")
            if field == b"event":
                name = text
            elif field == b"data":
                data.append(text)
        if data:
            out.append((name, json.loads("\n".join(data))))
    return out


def strict_consume(events: list[tuple[str | None, dict[str, Any]]]) -> dict[str, Any]:  # noqa: C901
    """Check the stream's lifecycle and return the message it builds.

    Raises:
        AssertionError: a rule is broken.
        StreamFailed: the stream carried an ``error`` event (after passing the checks).
    """
    message: dict[str, Any] | None = None
    open_block: dict[str, Any] | None = None
    signed = False
    partial = ""
    stage = "start"  # start → blocks → delta → stopped
    for name, data in events:
        assert name is not None, f"event without an event: line: {data}"
        assert name == data["type"], f"event name {name!r} != data.type {data['type']!r}"
        assert stage != "stopped", f"{name} after the end of the stream"
        if name == "ping":
            continue
        if name == "error":
            assert set(data) >= {"type", "error"} and set(data["error"]) >= {"type", "message"}
            raise StreamFailed(data["error"])
        if name == "message_start":
            assert stage == "start", "more than one message_start"
            message = dict(data["message"])
            assert message["content"] == [] and message["stop_reason"] is None
            assert {"input_tokens", "output_tokens"} <= set(message["usage"])
            stage = "blocks"
            continue
        assert message is not None, f"{name} before message_start"
        if name == "content_block_start":
            assert stage == "blocks" and open_block is None, "block starts while one is open"
            assert data["index"] == len(message["content"]), "block index not next dense index"
            open_block = dict(data["content_block"])
            if open_block["type"] == "tool_use":
                assert open_block["input"] == {}, "tool_use must start with input {}"
            signed, partial = False, ""
            message["content"].append(open_block)
        elif name == "content_block_delta":
            assert open_block is not None, "delta for a block that is not open"
            assert data["index"] == len(message["content"]) - 1, "delta for another index"
            delta = data["delta"]
            assert _DELTA_BLOCK[delta["type"]] == open_block["type"], "delta of the wrong type"
            assert not signed, "delta after the thinking block's signature"
            if delta["type"] == "text_delta":
                open_block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                open_block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                open_block["signature"], signed = delta["signature"], True
            else:
                partial += delta["partial_json"]
        elif name == "content_block_stop":
            assert open_block is not None, "stop for a block that is not open"
            assert data["index"] == len(message["content"]) - 1, "stop for another index"
            if open_block["type"] == "thinking":
                assert signed, "thinking block stopped without a signature_delta"
            if open_block["type"] == "tool_use":
                parsed = json.loads(partial) if partial else {}
                assert isinstance(parsed, dict), "tool input is not a JSON object"
                open_block["input"] = parsed
            open_block = None
        elif name == "message_delta":
            assert stage == "blocks" and open_block is None, "message_delta with a block open"
            assert data["delta"]["stop_reason"] is not None
            assert "output_tokens" in data["usage"]
            message["stop_reason"] = data["delta"]["stop_reason"]
            message["stop_sequence"] = data["delta"]["stop_sequence"]
            message["usage"] = {**message["usage"], **data["usage"]}
            stage = "delta"
        elif name == "message_stop":
            assert stage == "delta", "message_stop before message_delta"
            stage = "stopped"
        else:
            raise AssertionError(f"unknown event {name!r}")
    assert stage == "stopped", "stream ended without message_stop"
    assert message is not None
    return message
