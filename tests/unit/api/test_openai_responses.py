"""The Responses projector and render: events in, frames and objects out (no app, no Redis)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from services.api.wire.common import service_error as error_from_event
from services.api.wire.openai_responses import (
    Context as ResponsesContext,
    Projector as ResponsesProjector,
    parse_request,
    render,
    skeleton,
)
from services.api.wire.sse import encode
from shared.accumulate import fold
from shared.errors import Overloaded
from shared.events import AnyEvent, Error, Finish, Start, TextDelta, TokenLogprob, TopLogprob, Usage
from tests.factories import SCENARIOS
from tests.invariants import check_stream

RID = "resp_0123456789abcdef01234567"
TERMINALS = {"response.completed", "response.incomplete", "response.failed"}


def _skeleton() -> Any:
    req = parse_request(b'{"model": "tiny-test", "input": "hi"}')
    return skeleton(req, RID, 1_700_000_000)


def project(events: list[AnyEvent], starting_after: int = -1) -> list[dict[str, Any]]:
    check_stream(events)
    projector = ResponsesProjector(
        ResponsesContext(skeleton=_skeleton(), starting_after=starting_after)
    )
    frames = [f for e in events for f in projector.feed(e)] + projector.close()
    out = []
    for frame in frames:
        data = json.loads(frame.data)
        assert frame.event == data["type"], "event: line must equal data.type"
        out.append(data)
    return out


def _rendered(events: list[AnyEvent]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(msgspec.json.encode(render(fold(events), _skeleton())))
    return out


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_stream_structure(name: str) -> None:
    out = project(SCENARIOS[name]())
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[0]["type"] == "response.created"
    assert out[0]["response"]["output"] == []
    assert out[0]["response"]["status"] == "in_progress"
    assert out[1]["type"] == "response.in_progress"
    assert out[-1]["type"] in TERMINALS
    assert sum(e["type"] in TERMINALS for e in out) == 1
    ids = {e["response"]["id"] for e in out if "response" in e}
    assert ids == {RID}
    open_index: int | None = None
    open_id = ""
    next_index = 0
    parts: set[tuple[int, int]] = set()
    done_items = []
    for e in out[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert open_index is None, "an item opened before the previous one was done"
            assert e["output_index"] == next_index
            open_index, open_id = next_index, e["item"]["id"]
            assert e["item"]["status"] == "in_progress"
        elif kind == "response.output_item.done":
            assert (e["output_index"], e["item"]["id"]) == (open_index, open_id)
            open_index, next_index = None, next_index + 1
            done_items.append(e["item"])
        elif kind == "response.content_part.added":
            parts.add((e["output_index"], e["content_index"]))
        elif kind == "error":
            assert out[-1]["type"] == "response.failed"
        else:
            assert e["output_index"] == open_index, f"{kind} outside its item"
            if kind.startswith(("response.output_text", "response.reasoning_text")):
                assert (e["output_index"], e["content_index"]) in parts
            assert e["item_id"] == open_id
    assert open_index is None
    final = out[-1]["response"]
    assert final["output"] == done_items, "terminal output must equal the output_item.done items"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_terminal_response_equals_render_of_fold(name: str) -> None:
    events = SCENARIOS[name]()
    assert project(events)[-1]["response"] == _rendered(events)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reprojection_is_byte_identical(name: str) -> None:
    def transcript() -> bytes:
        projector = ResponsesProjector(ResponsesContext(skeleton=_skeleton()))
        return b"".join(encode(f) for e in SCENARIOS[name]() for f in projector.feed(e))

    assert transcript() == transcript()


@pytest.mark.parametrize("after", [0, 3, 7])
def test_starting_after_replays_the_suffix(after: int) -> None:
    events = SCENARIOS["parallel_tool_calls"]()
    full = project(events)
    assert project(events, starting_after=after) == full[after + 1 :]


def test_function_calls_have_item_and_call_ids() -> None:
    out = project(SCENARIOS["parallel_tool_calls"]())
    calls = out[-1]["response"]["output"][1:]
    assert [c["type"] for c in calls] == ["function_call", "function_call"]
    assert [c["call_id"] for c in calls] == ["call_a1", "call_b2"]
    assert all(c["id"].startswith("fc_") and c["status"] == "completed" for c in calls)
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    deltas = [e for e in out if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(d["delta"] for d in deltas if d["output_index"] == 2) == '{"city": "Oslo"}'
    done = [e for e in out if e["type"] == "response.function_call_arguments.done"]
    assert [(d["item_id"], d["name"]) for d in done] == [(c["id"], "get_weather") for c in calls]


def test_reasoning_item_then_message() -> None:
    out = project(SCENARIOS["reasoning"]())
    final = out[-1]["response"]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user greets me."}]
    assert message["content"][0]["text"] == "Hi there."
    assert final["usage"] == {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 4},
        "total_tokens": 19,
    }


def test_max_tokens_is_incomplete() -> None:
    final = project(SCENARIOS["max_tokens"]())[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_mid_stream_error_is_error_then_failed() -> None:
    out = project(SCENARIOS["error"]())
    assert [e["type"] for e in out[-2:]] == ["error", "response.failed"]
    assert out[-2]["code"] == "server_error"
    assert out[-1]["response"]["error"]["code"] == "server_error"
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "Partial"


def test_error_before_start_still_opens_with_created() -> None:
    out = project(SCENARIOS["error_before_start"]())
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert out[-1]["response"]["output"] == []
    err = error_from_event(SCENARIOS["error_before_start"]()[0])  # type: ignore[arg-type]
    assert isinstance(err, Overloaded)
    # the start timeout's overload is retryable: both the in-band event and the object say so
    assert out[-2]["retryable"] is True and out[-1]["response"]["error"]["retryable"] is True
    assert err.retryable and err.retry_after == 1.0  # the 503 carries Retry-After


def test_cancelled_before_start_is_cancelled_not_failed() -> None:
    events = SCENARIOS["cancelled_before_start"]()
    out = project(events)
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.incomplete",
    ]
    final = out[-1]["response"]
    assert (final["status"], final["error"], final["output"]) == ("cancelled", None, [])
    assert final == _rendered(events)


def test_cancelled_finish_is_cancelled_status() -> None:
    events: list[AnyEvent] = [
        Start(request_id=RID, model="m", prompt_tokens=3),
        TextDelta(text="Par"),
        Usage(input_tokens=3, output_tokens=1),
        Finish(reason="cancelled"),
    ]
    final = project(events)[-1]
    assert (final["type"], final["response"]["status"]) == ("response.incomplete", "cancelled")
    assert final["response"] == _rendered(events)


def test_logprobs_ride_on_deltas_and_parts() -> None:
    lp = TokenLogprob(token="Hi", logprob=-0.5, top=[TopLogprob(token="Yo", logprob=-1.0)])
    events: list[AnyEvent] = [
        Start(request_id=RID, model="m", prompt_tokens=3),
        TextDelta(text="Hi", token_ids=[1], logprobs=[lp]),
        Usage(input_tokens=3, output_tokens=1),
        Finish(reason="end_turn"),
    ]
    out = project(events)
    delta = next(e for e in out if e["type"] == "response.output_text.delta")
    expected = [
        {
            "token": "Hi",
            "bytes": [72, 105],
            "logprob": -0.5,
            "top_logprobs": [{"token": "Yo", "bytes": [89, 111], "logprob": -1.0}],
        }
    ]
    assert delta["logprobs"] == expected
    assert out[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected
    assert out[-1]["response"] == _rendered(events)


def test_partial_log_renders_in_progress() -> None:
    events = SCENARIOS["text"]()[:3]
    check_stream(events, complete=False)
    response = _rendered(events)
    assert response["status"] == "in_progress"
    assert response["usage"] is None
    assert response["output"][0]["status"] == "in_progress"
    assert response["output"][0]["content"][0]["text"] == "Hello, world"


def test_nothing_after_the_terminal_event() -> None:
    projector = ResponsesProjector(ResponsesContext(skeleton=_skeleton()))
    for event in SCENARIOS["text"]():
        projector.feed(event)
    assert projector.feed(Error(kind="internal", message="late")) == []
    assert projector.close() == []
