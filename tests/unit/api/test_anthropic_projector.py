"""Unit tests of the Anthropic projector and renderer: events in, frames and messages out."""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from services.api.wire import sse
from services.api.wire.anthropic_messages import (
    PING,
    Context as MessageContext,
    Projector as AnthropicProjector,
    error_body as anthropic_error_body,
    render as render_message,
    service_error,
    tool_use_id,
)
from shared.accumulate import Completion, fold
from shared.errors import ServiceError
from shared.events import (
    AnyEvent,
    Error,
    ErrorKind,
    Finish,
    FinishReason,
    ReasoningDelta,
    ReasoningEnd,
    Start,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from tests.factories import SCENARIOS
from tests.golden.anthropic_messages.consumer import parse_sse, strict_consume
from tests.invariants import check_stream

CTX = MessageContext(message_id="msg_test", model="tiny-test")
START = Start(request_id="msg_test", model="tiny-test", prompt_tokens=20, cached_tokens=5)


def project(events: list[AnyEvent], ctx: MessageContext = CTX) -> list[tuple[str | None, Any]]:
    projector = AnthropicProjector(ctx)
    frames = [f for e in events for f in projector.feed(e)] + projector.close()
    return parse_sse(b"".join(sse.encode(f) for f in frames))


def render(completion: Completion, ctx: MessageContext) -> dict[str, Any]:
    """The rendered message as the JSON object a client decodes."""
    message: dict[str, Any] = msgspec.to_builtins(render_message(completion, ctx))
    return message


def shape(frames: list[tuple[str | None, Any]]) -> list[str]:
    """Event names, with the delta or block type for block events."""
    out = []
    for name, data in frames:
        if name == "content_block_delta":
            out.append(f"delta:{data['delta']['type']}")
        elif name == "content_block_start":
            out.append(f"start:{data['content_block']['type']}")
        else:
            out.append(str(name))
    return out


def finished(*body: AnyEvent, reason: Any = "end_turn", stop: str | None = None) -> list[AnyEvent]:
    events = [START, *body, Usage(input_tokens=20, output_tokens=9, cached_tokens=5)]
    events.append(Finish(reason=reason, stop_sequence=stop))
    check_stream(events)
    return events


def test_reasoning_then_tool_call_block_sequence() -> None:
    frames = project(SCENARIOS["reasoning_tool_call"]())
    assert shape(frames) == [
        "message_start",
        "start:thinking",
        "delta:thinking_delta",
        "delta:signature_delta",
        "content_block_stop",
        "start:tool_use",
        "delta:input_json_delta",
        "delta:input_json_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    blocks = [d["index"] for n, d in frames if (n or "").startswith("content_block")]
    assert blocks == [0] * 4 + [1] * 4
    tool = frames[5][1]["content_block"]
    assert tool == {"type": "tool_use", "id": "toolu_a1", "name": "get_weather", "input": {}}


def test_usage_excludes_cache_reads_and_is_cumulative() -> None:
    frames = project(finished(TextDelta(text="hi")))
    start_usage = frames[0][1]["message"]["usage"]
    assert start_usage == {
        "input_tokens": 15,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 5,
        "output_tokens": 0,
    }
    name, delta = frames[-2]
    assert name == "message_delta"
    assert delta["usage"] == {**start_usage, "output_tokens": 9}


@pytest.mark.parametrize(
    ("reason", "stop", "expected"),
    [
        ("end_turn", None, ("end_turn", None)),
        ("max_tokens", None, ("max_tokens", None)),
        ("tool_use", None, ("tool_use", None)),
        ("stop_sequence", "###", ("stop_sequence", "###")),
        ("cancelled", None, ("end_turn", None)),
    ],
)
def test_stop_reasons(reason: Any, stop: str | None, expected: tuple[str, str | None]) -> None:
    events = finished(TextDelta(text="x"), reason=reason, stop=stop)
    delta = project(events)[-2][1]["delta"]
    assert (delta["stop_reason"], delta["stop_sequence"]) == expected
    message = render(fold(events), CTX)
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_thinking_cut_by_max_tokens_still_gets_signature_before_stop() -> None:
    events = finished(ReasoningDelta(text="hmm"), reason="max_tokens")
    assert shape(project(events))[1:5] == [
        "start:thinking",
        "delta:thinking_delta",
        "delta:signature_delta",
        "content_block_stop",
    ]


def test_text_interrupting_reasoning_closes_thinking_block_with_signature() -> None:
    events = finished(
        ReasoningDelta(text="a"),
        TextDelta(text="b"),
        ReasoningDelta(text="c"),
        ReasoningEnd(signature="sig-c"),
    )
    frames = project(events)
    assert shape(frames)[1:-2] == [
        "start:thinking",
        "delta:thinking_delta",
        "delta:signature_delta",
        "content_block_stop",
        "start:text",
        "delta:text_delta",
        "content_block_stop",
        "start:thinking",
        "delta:thinking_delta",
        "delta:signature_delta",
        "content_block_stop",
    ]
    assert strict_consume(frames) == render(fold(events), CTX)
    assert render(fold(events), CTX)["content"][2]["signature"] == "sig-c"


def test_omitted_thinking_keeps_block_and_signature_but_no_text() -> None:
    ctx = MessageContext(message_id="msg_test", model="tiny-test", show_thinking=False)
    events = finished(
        ReasoningDelta(text="secret"), ReasoningEnd(signature="s"), TextDelta(text="hi")
    )
    frames = project(events, ctx)
    assert "delta:thinking_delta" not in shape(frames)
    assert "secret" not in json.dumps(frames)
    message = render(fold(events), ctx)
    assert message["content"][0] == {"type": "thinking", "thinking": "", "signature": "s"}
    assert strict_consume(frames) == message


def test_empty_text_delta_opens_block_without_empty_delta() -> None:
    frames = project(finished(TextDelta(text="")))
    assert shape(frames)[1:3] == ["start:text", "content_block_stop"]


def test_error_before_start_is_a_single_error_event() -> None:
    frames = project(SCENARIOS["error_before_start"]())
    assert frames == [
        (
            "error",
            {
                "type": "error",
                "error": {
                    "type": "overloaded_error",
                    "message": "no worker took the request in time",
                },
            },
        )
    ]


@pytest.mark.parametrize(
    ("kind", "wire_type", "status"),
    [
        ("overloaded", "overloaded_error", 529),
        ("internal", "api_error", 500),
        ("worker_lost", "api_error", 500),
        ("cancelled", "invalid_request_error", 499),
        ("invalid_request", "invalid_request_error", 400),
        ("context_overflow", "invalid_request_error", 400),
    ],
)
def test_error_kinds_in_stream_and_non_stream(kind: ErrorKind, wire_type: str, status: int) -> None:
    events: list[AnyEvent] = [START, TextDelta(text="x"), Error(kind=kind, message="boom")]
    check_stream(events)
    frames = project(events)
    assert frames[-1] == (
        "error",
        {"type": "error", "error": {"type": wire_type, "message": "boom"}},
    )
    assert "message_stop" not in shape(frames)
    with pytest.raises(ServiceError) as raised:
        render(fold(events), CTX)
    # The API core's envelope must agree with the in-band error type for the same failure.
    assert anthropic_error_body(raised.value) == (
        status,
        {"type": "error", "error": {"type": wire_type, "message": "boom"}},
    )


def test_overloaded_error_carries_retry_after_when_retryable() -> None:
    assert service_error(Error(kind="overloaded", message="m", retryable=True)).retry_after == 1.0
    assert service_error(Error(kind="overloaded", message="m")).retry_after is None


def test_events_after_terminal_and_duplicate_start_are_ignored() -> None:
    projector = AnthropicProjector(CTX)
    assert len(projector.feed(START)) == 1
    assert projector.feed(Start(request_id="msg_test", model="m", prompt_tokens=1, attempt=2)) == []
    projector.feed(Usage(input_tokens=1, output_tokens=0))
    assert [f.event for f in projector.feed(Finish(reason="end_turn"))] == [
        "message_delta",
        "message_stop",
    ]
    assert projector.feed(TextDelta(text="late")) == []
    assert projector.feed(Error(kind="internal", message="late")) == []


def test_truncated_tool_call_renders_object_input() -> None:
    completion = fold(
        [
            START,
            ToolCallStart(index=0, call_id="call_x", name="f"),
            ToolCallArgsDelta(index=0, fragment='{"a": '),
        ]
    )
    message = render(completion, CTX)
    assert message["content"] == [{"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}]
    assert message["usage"]["input_tokens"] == 15


def test_parameterless_tool_input_is_empty_object() -> None:
    message = render(fold(SCENARIOS["parameterless_tool_call"]()), CTX)
    assert message["content"][0]["input"] == {}
    assert message["stop_reason"] == "tool_use"


def test_tool_use_id_mapping() -> None:
    assert tool_use_id("call_abc") == "toolu_abc"
    assert tool_use_id("toolu_abc") == "toolu_abc"
    assert tool_use_id("7") == "toolu_7"


def test_ping_frame() -> None:
    assert sse.encode(PING) == b'event: ping\ndata: {"type":"ping"}\n\n'


# -- property: any valid event stream projects to a strict stream equal to render(fold) -----


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    out: list[str] = []
    for a, b in itertools.pairwise(points):
        # the contract forbids whitespace-only fragments: glue them onto their neighbour
        if out and (not text[a:b].strip() or not out[-1].strip()):
            out[-1] += text[a:b]
        else:
            out.append(text[a:b])
    return out


@st.composite
def streams(draw: st.DrawFn) -> list[AnyEvent]:
    events: list[AnyEvent] = [START]
    calls = 0
    words = st.text(alphabet='ab c"\\é\n', min_size=0, max_size=8)
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["text", "reasoning", "tool"]))
        if kind == "text":
            events.extend(TextDelta(text=t) for t in draw(st.lists(words, min_size=1, max_size=3)))
        elif kind == "reasoning":
            events.extend(
                ReasoningDelta(text=t) for t in draw(st.lists(words, min_size=1, max_size=3))
            )
            if draw(st.booleans()):
                events.append(ReasoningEnd(signature=draw(st.none() | st.just("sig"))))
        else:
            args = json.dumps({"q": draw(words)}) if draw(st.booleans()) else "{}"
            events.append(ToolCallStart(index=calls, call_id=f"call_{calls}", name="f"))
            cuts = draw(st.lists(st.integers(0, 40), max_size=4))
            events.extend(ToolCallArgsDelta(index=calls, fragment=f) for f in _split(args, cuts))
            events.append(ToolCallEnd(index=calls, arguments=args))
            calls += 1
    events.append(Usage(input_tokens=20, output_tokens=len(events), cached_tokens=5))
    reasons: list[FinishReason] = ["end_turn", "max_tokens", "tool_use", "stop_sequence"]
    reason = draw(st.sampled_from(reasons))
    events.append(Finish(reason=reason, stop_sequence="###" if reason == "stop_sequence" else None))
    return events


@settings(max_examples=150, deadline=None)
@given(streams())
def test_any_valid_stream_is_strict_and_matches_render(events: list[AnyEvent]) -> None:
    check_stream(events)
    assert strict_consume(project(events)) == render(fold(events), CTX)
