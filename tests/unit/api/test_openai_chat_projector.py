"""Chat Completions projector and render: events in, chunks (and one response) out."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.api.wire.common import service_error as error_from_event
from services.api.wire.openai_chat import (
    Context as ChatContext,
    Projector as ChatProjector,
    render,
)
from services.api.wire.openai_chat.types import ReasoningField
from services.api.wire.sse import Frame
from shared.accumulate import fold
from shared.errors import (
    Cancelled,
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
    ReasoningEnd,
    Start,
    TextDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tests.factories import SCENARIOS
from tests.invariants import check_stream

CTX = ChatContext(id="chatcmpl-1", created=1_700_000_000, model="tiny-test")


def project(events: list[AnyEvent], ctx: ChatContext = CTX) -> list[object]:
    """All frames as decoded JSON (``"[DONE]"`` stays a string)."""
    check_stream(events)
    projector = ChatProjector(ctx)
    frames: list[Frame] = [f for e in events for f in projector.feed(e)]
    frames += projector.close()
    assert projector.close() == []  # [DONE] exactly once
    out: list[object] = []
    for frame in frames:
        assert frame.event is None  # chat is data-only
        data = frame.data if isinstance(frame.data, bytes) else frame.data.encode()
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def deltas(chunks: list[object]) -> list[dict[str, object]]:
    return [c["choices"][0]["delta"] for c in chunks if isinstance(c, dict) and c.get("choices")]


def test_start_alone_sends_nothing() -> None:
    start = SCENARIOS["text"]()[0]
    check_stream([start], complete=False)
    assert ChatProjector(CTX).feed(start) == []


@pytest.mark.parametrize(
    "scenario", [s for s in SCENARIOS if not isinstance(SCENARIOS[s]()[-1], Error)]
)
def test_role_only_in_first_delta_and_ids_only_in_first_call_delta(scenario: str) -> None:
    for shown in (False, True):
        ctx = msgspec.structs.replace(CTX, include_reasoning=shown)
        chunks = project(SCENARIOS[scenario](), ctx)
        assert chunks[-1] == "[DONE]"
        ds = deltas(chunks)
        assert ds[0]["role"] == "assistant"
        assert all("role" not in d for d in ds[1:])
        seen: set[int] = set()
        for d in ds:
            for call in d.get("tool_calls", []):  # type: ignore[attr-defined]
                first = call["index"] not in seen
                assert ("id" in call) == first and ("type" in call) == first
                assert ("name" in call["function"]) == first
                seen.add(call["index"])
        assert sorted(seen) == list(range(len(seen)))
        for chunk in chunks[:-1]:
            assert chunk["object"] == "chat.completion.chunk"  # type: ignore[index]
            assert (chunk["id"], chunk["created"]) == ("chatcmpl-1", 1_700_000_000)  # type: ignore[index]


def test_finish_without_any_delta_still_carries_the_role() -> None:
    events: list[AnyEvent] = [
        Start(request_id="r", model="m", prompt_tokens=3),
        Usage(input_tokens=3, output_tokens=1),
        Finish(reason="end_turn", token_ids=[2]),
    ]
    chunks = project(events)
    # refusal: null on the first chunk, as OpenAI sends it.
    assert deltas(chunks) == [{"role": "assistant", "content": "", "refusal": None}]
    assert chunks[0]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]


@pytest.mark.parametrize(
    ("scenario", "reason"),
    [
        ("text", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_call", "tool_calls"),
        ("parallel_tool_calls", "tool_calls"),
    ],
)
def test_finish_reason_mapping(scenario: str, reason: str) -> None:
    events = SCENARIOS[scenario]()
    finishes = [c["choices"][0]["finish_reason"] for c in project(events)[:-1]]  # type: ignore[index]
    assert finishes[-1] == reason and set(finishes[:-1]) == {None}
    assert render(fold(events), CTX).choices[0].finish_reason == reason


def test_natural_end_after_tool_calls_reports_tool_calls() -> None:
    events = SCENARIOS["tool_call"]()
    events[-1] = Finish(reason="end_turn", token_ids=[2])
    assert project(events)[-2]["choices"][0]["finish_reason"] == "tool_calls"  # type: ignore[index]


def test_usage_chunk_only_when_asked_and_last() -> None:
    events = SCENARIOS["reasoning"]()
    plain = project(events)
    assert all("usage" not in c for c in plain[:-1])  # type: ignore[operator]
    with_usage = project(events, msgspec.structs.replace(CTX, include_usage=True))
    assert all(c["usage"] is None for c in with_usage[:-2])  # type: ignore[index]
    assert with_usage[-2] == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "tiny-test",
        "choices": [],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 7,
            "total_tokens": 19,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 4},
        },
    }


@pytest.mark.parametrize(
    ("field", "keys"),
    [
        ("reasoning_content", {"reasoning_content"}),
        ("reasoning", {"reasoning"}),
        ("both", {"reasoning_content", "reasoning"}),
    ],
)
def test_reasoning_only_when_opted_in_under_the_configured_field(
    field: ReasoningField, keys: set[str]
) -> None:
    events = SCENARIOS["reasoning"]()
    hidden = deltas(project(events, msgspec.structs.replace(CTX, reasoning_field=field)))
    assert hidden == [{"role": "assistant", "content": "Hi there.", "refusal": None}, {}]
    ctx = msgspec.structs.replace(CTX, reasoning_field=field, include_reasoning=True)
    shown = deltas(project(events, ctx))
    assert shown[0] == {"role": "assistant", "content": None, "refusal": None} | dict.fromkeys(
        keys, "The user greets"
    )
    assert shown[1] == dict.fromkeys(keys, " me.")
    message = render(fold(events), ctx).choices[0].message
    as_json = json.loads(msgspec.json.encode(message))
    assert {k: as_json.get(k) for k in keys} == dict.fromkeys(keys, "The user greets me.")
    hidden_message = json.loads(msgspec.json.encode(render(fold(events), CTX).choices[0].message))
    assert "reasoning_content" not in hidden_message and "reasoning" not in hidden_message


INLINE = msgspec.structs.replace(
    CTX, include_reasoning=True, reasoning_markers=("<think>", "</think>")
)


def streamed_content(events: list[AnyEvent], ctx: ChatContext) -> str:
    return "".join(str(d.get("content") or "") for d in deltas(project(events, ctx)))


@pytest.mark.parametrize(
    ("scenario", "content"),
    [
        ("reasoning", "<think>The user greets me.</think>Hi there."),
        ("reasoning_tool_call", "<think>Need the weather.</think>"),
        ("text", None),  # no reasoning: the content is the answer alone, as without inline
    ],
)
def test_inline_reasoning_sits_in_content_between_the_model_s_markers(
    scenario: str, content: str | None
) -> None:
    """reasoning_format "inline": streamed and rendered alike, no reasoning field at all."""
    events = SCENARIOS[scenario]()
    expected = content if content is not None else fold(events).text
    assert streamed_content(events, INLINE) == expected
    message = json.loads(msgspec.json.encode(render(fold(events), INLINE).choices[0].message))
    assert (message["content"] or "") == expected
    assert "reasoning_content" not in message and "reasoning" not in message
    shown = deltas(project(events, INLINE))
    assert all("reasoning_content" not in d and "reasoning" not in d for d in shown)


def test_inline_reasoning_cut_short_has_no_close_marker() -> None:
    """A block cut by max_tokens ends as the model left it: open marker, no close."""
    events = [e for e in SCENARIOS["reasoning"]() if not isinstance(e, ReasoningEnd | TextDelta)]
    events[-1] = Finish(reason="max_tokens")
    assert streamed_content(events, INLINE) == "<think>The user greets me."
    assert render(fold(events), INLINE).choices[0].message.content == "<think>The user greets me."


def test_mid_stream_error_is_an_error_object_then_done() -> None:
    chunks = project(SCENARIOS["error"]())
    assert chunks[-2:] == [
        {
            "error": {
                "message": "CUDA error: device-side assert triggered",
                "type": "server_error",
                "param": None,
                "code": "internal",
                "retryable": True,  # the scenario's Error says so
            }
        },
        "[DONE]",
    ]


def test_logprobs_ride_on_content_chunks_and_the_response() -> None:
    lp = TokenLogprob(token="Hi", logprob=-0.25, bytes=[72, 105], top=[TopLogprob("Hi", -0.25)])
    events: list[AnyEvent] = [
        Start(request_id="r", model="m", prompt_tokens=3),
        TextDelta(text="Hi", token_ids=[5], logprobs=[lp]),
        Usage(input_tokens=3, output_tokens=1),
        Finish(reason="end_turn"),
    ]
    expected = {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.25,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": None}],
            }
        ],
        "refusal": None,
    }
    ctx = msgspec.structs.replace(CTX, logprobs=True)
    assert project(events, ctx)[0]["choices"][0]["logprobs"] == expected  # type: ignore[index]
    assert project(events)[0]["choices"][0]["logprobs"] is None  # type: ignore[index]
    body = json.loads(msgspec.json.encode(render(fold(events), ctx)))
    assert body["choices"][0]["logprobs"] == expected


def test_render_tool_calls_only_has_null_content() -> None:
    body = json.loads(msgspec.json.encode(render(fold(SCENARIOS["parallel_tool_calls"]()), CTX)))
    assert body["choices"][0]["message"]["content"] == "Checking both."
    body = json.loads(msgspec.json.encode(render(fold(SCENARIOS["tool_call"]()), CTX)))
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "tiny-test",
        "choices": [
            {
                "index": 0,
                "message": {
                    "content": None,
                    "role": "assistant",
                    "refusal": None,
                    "tool_calls": [
                        {
                            "id": "call_a1",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                            "type": "function",
                        }
                    ],
                },
                "finish_reason": "tool_calls",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 6,
            "total_tokens": 18,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
        "system_fingerprint": None,
    }


def test_render_text_has_no_tool_calls_key() -> None:
    message = json.loads(msgspec.json.encode(render(fold(SCENARIOS["text"]()), CTX)))
    assert message["choices"][0]["message"]["content"] == "Hello, world!"
    assert "tool_calls" not in message["choices"][0]["message"]


@pytest.mark.parametrize(
    ("kind", "cls", "status"),
    [
        ("invalid_request", InvalidRequest, 400),
        ("context_overflow", ContextOverflow, 400),
        ("overloaded", Overloaded, 529),
        ("worker_lost", WorkerLost, 500),
        ("internal", ServiceError, 500),
        ("cancelled", Cancelled, 499),
    ],
)
def test_error_from_event(kind: ErrorKind, cls: type[ServiceError], status: int) -> None:
    err = error_from_event(Error(kind=kind, message="boom"))
    assert type(err) is cls and err.message == "boom" and err.http_status == status
    assert err.retryable is False and err.retry_after is None  # the event's flag, not the class's
    again = error_from_event(Error(kind=kind, message="boom", retryable=True))
    assert again.retryable is True
    # only a retryable overload (the start timeout) advertises Retry-After, in every format
    assert again.retry_after == (1.0 if kind == "overloaded" else None)


def test_cancelled_before_start_is_a_client_side_error_in_band() -> None:
    chunks = project(SCENARIOS["cancelled_before_start"]())
    assert chunks == [
        {
            "error": {
                "message": "cancelled before generation started",
                "type": "invalid_request_error",
                "param": None,
                "code": "cancelled",
                "retryable": False,
            }
        },
        "[DONE]",
    ]
