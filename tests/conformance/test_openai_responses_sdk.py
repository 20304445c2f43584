"""The openai SDK parses every golden Responses transcript, served over real HTTP.

A tiny Starlette app on a real uvicorn server returns the golden bytes for streaming requests and
``render(fold(events))`` for non-streaming ones, picked by ``metadata.golden``. Parity: the SDK's
``responses.stream(...).get_final_response()`` equals the non-streaming response for the same
events. A Codex-style consumer builds its history only from ``response.output_item.done``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgspec
import openai
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseIncompleteEvent,
)
from starlette.requests import Request
from starlette.responses import Response

from services.api.wire.openai_responses import render
from shared.accumulate import fold
from tests.conformance.transcript_server import serve_post
from tests.factories import SCENARIOS
from tests.golden.test_openai_responses import GOLDEN_DIR, REQUEST, RESPONSE_ID, golden_skeleton
from tests.invariants import check_stream

FAILED = ["error", "error_before_start"]
CANCELLED = ["cancelled_before_start"]  # status "cancelled", announced by response.incomplete
COMPLETED = [s for s in sorted(SCENARIOS) if s not in ("max_tokens", *FAILED, *CANCELLED)]


async def _responses(request: Request) -> Response:
    body = json.loads(await request.body())
    scenario = body["metadata"]["golden"]
    if body.get("stream"):
        data = (GOLDEN_DIR / f"{scenario}.sse").read_bytes()
        return Response(data, media_type="text/event-stream; charset=utf-8")
    events = SCENARIOS[scenario]()
    check_stream(events)
    rendered = render(fold(events), golden_skeleton())
    return Response(msgspec.json.encode(rendered), media_type="application/json")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A real uvicorn server in a thread, serving the golden transcripts."""
    with serve_post("/v1/responses", _responses) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """The official SDK client, no retries (a retry would hide a failure)."""
    with openai.OpenAI(base_url=base_url, api_key="test", max_retries=0) as c:
        yield c


def _plain(value: object) -> object:
    """Drop the stream helper's ``parsed``/``parsed_arguments`` additions for comparison."""
    if isinstance(value, dict):
        skip = ("parsed", "parsed_arguments")
        return {k: _plain(v) for k, v in value.items() if k not in skip}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _request(scenario: str) -> dict[str, object]:
    return {**REQUEST, "metadata": {"golden": scenario}}


@pytest.mark.parametrize("scenario", COMPLETED)
def test_stream_helper_final_response_equals_non_streaming(
    client: openai.OpenAI, scenario: str
) -> None:
    expected = client.responses.create(**_request(scenario))  # type: ignore[call-overload]
    with client.responses.stream(**_request(scenario)) as stream:  # type: ignore[call-overload]
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert _plain(final.model_dump()) == _plain(expected.model_dump())
    assert final.id == RESPONSE_ID
    assert final.status == "completed"
    folded = fold(SCENARIOS[scenario]())
    assert final.output_text == folded.text
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        (b.call_id, b.name, json.loads(b.arguments)) for b in folded.tool_calls
    ]
    assert all(c.id and c.id.startswith("fc_") for c in calls)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    if folded.text:
        assert "response.output_text.done" in kinds
    if calls:
        assert "response.function_call_arguments.done" in kinds
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 4
    if folded.reasoning:
        assert final.usage.output_tokens_details.reasoning_tokens > 0
        reasoning = [item for item in final.output if item.type == "reasoning"]
        assert reasoning[0].content is not None
        assert reasoning[0].content[0].text == folded.reasoning


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_raw_stream_events_are_typed_and_sequenced(client: openai.OpenAI, scenario: str) -> None:
    events = list(client.responses.create(stream=True, **_request(scenario)))  # type: ignore[call-overload]
    assert isinstance(events[0], ResponseCreatedEvent)
    assert events[0].response.output == []
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    if scenario in FAILED:
        assert isinstance(events[-2], ResponseErrorEvent)
        assert isinstance(last, ResponseFailedEvent)
        assert last.response.error is not None
    elif scenario in CANCELLED:
        assert isinstance(last, ResponseIncompleteEvent)
        assert last.response.status == "cancelled" and last.response.error is None
    elif scenario == "max_tokens":
        assert isinstance(last, ResponseIncompleteEvent)
        assert last.response.incomplete_details is not None
        assert last.response.incomplete_details.reason == "max_output_tokens"
    else:
        assert isinstance(last, ResponseCompletedEvent)


@pytest.mark.parametrize("scenario", ["max_tokens", *FAILED, *CANCELLED])
def test_unfinished_responses_raise_in_get_final_response(
    client: openai.OpenAI, scenario: str
) -> None:
    with client.responses.stream(**_request(scenario)) as stream:  # type: ignore[call-overload]
        kinds = [event.type for event in stream]
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            stream.get_final_response()
    assert kinds[-1] in ("response.incomplete", "response.failed")
    expected = client.responses.create(**_request(scenario))  # type: ignore[call-overload]
    statuses = {"max_tokens": "incomplete", **dict.fromkeys(CANCELLED, "cancelled")}
    assert expected.status == statuses.get(scenario, "failed")


def _sse_events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, object]]]:
    """A minimal SSE reader, as Codex's: ``event:`` + ``data:`` lines, blank line ends one."""
    name, data = "", list[str]()
    for line in lines:
        if not line:
            if data:
                yield name, json.loads("\n".join(data))
            name, data = "", list[str]()
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


@pytest.mark.parametrize("scenario", ["reasoning_tool_call", "parallel_tool_calls", "text"])
def test_codex_style_history_from_output_item_done(base_url: str, scenario: str) -> None:
    history: list[dict[str, object]] = []
    completed: dict[str, object] | None = None
    with (
        httpx.Client() as http,
        http.stream(
            "POST", f"{base_url}/responses", json={**_request(scenario), "stream": True}
        ) as response,
    ):
        for name, data in _sse_events(response.iter_lines()):
            assert completed is None, "nothing may follow response.completed"
            assert name == data["type"]
            if name == "response.output_item.done":
                history.append(data["item"])  # type: ignore[arg-type]
            elif name == "response.completed":
                completed = data
    assert completed is not None, "EOF before response.completed"
    assert history == completed["response"]["output"]  # type: ignore[index]
