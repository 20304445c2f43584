"""The official ``anthropic`` SDK parses every golden Anthropic transcript.

A tiny Starlette app on a real uvicorn socket serves the transcript picked by
``metadata.script`` (the same selector the scripted worker honours), so the SDK's own SSE
decoder and stream accumulator run unmodified. The final message the SDK accumulates must
equal the non-streaming ``render(fold(events))`` of the same events.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import pytest
from anthropic.types import Message
from starlette.requests import Request
from starlette.responses import Response

from services.api.wire.anthropic_messages import Context as MessageContext, render
from services.api.wire.sse import MEDIA_TYPE
from shared.accumulate import fold
from shared.events import Error
from tests.conformance.transcript_server import serve_post
from tests.factories import SCENARIOS
from tests.invariants import check_stream

GOLDEN = Path(__file__).parents[1] / "golden" / "anthropic_messages"
CTX = MessageContext(message_id="msg_0000000000000001", model="tiny-test")
FINISHED = sorted(n for n in SCENARIOS if not isinstance(SCENARIOS[n]()[-1], Error))
FAILED = sorted(n for n in SCENARIOS if isinstance(SCENARIOS[n]()[-1], Error))


async def _messages(request: Request) -> Response:
    body = json.loads(await request.body())
    name = body["metadata"]["script"]
    if body.get("stream"):
        return Response((GOLDEN / f"{name}.sse").read_bytes(), media_type=MEDIA_TYPE)
    body = msgspec.json.encode(render(fold(SCENARIOS[name]()), CTX))
    return Response(body, media_type="application/json")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A real uvicorn server in a thread, serving the golden transcripts."""
    with serve_post("/v1/messages", _messages) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=base_url, api_key="test", max_retries=0) as c:
        yield c


def request(name: str) -> dict[str, Any]:
    return {
        "model": "tiny-test",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hi"}],
        "metadata": {"user_id": "u", "script": name},
    }


def expected(name: str) -> dict[str, Any]:
    events = SCENARIOS[name]()
    check_stream(events)
    message = msgspec.to_builtins(render(fold(events), CTX))
    return Message.model_validate(message).model_dump(exclude_none=True)


@pytest.mark.parametrize("name", FINISHED)
def test_stream_helper_final_message_equals_non_streaming(
    client: anthropic.Anthropic, name: str
) -> None:
    with client.messages.stream(**request(name)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.model_dump(exclude_none=True) == expected(name)
    assert text == fold(SCENARIOS[name]()).text


@pytest.mark.parametrize("name", FINISHED)
def test_create_stream_yields_typed_events(client: anthropic.Anthropic, name: str) -> None:
    raw = (GOLDEN / f"{name}.sse").read_bytes().decode()
    names = [line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event:")]
    with client.messages.create(**request(name), stream=True) as stream:
        assert [event.type for event in stream] == names


@pytest.mark.parametrize("name", FINISHED)
def test_non_streaming_message_parses(client: anthropic.Anthropic, name: str) -> None:
    message = client.messages.create(**request(name))
    assert message.model_dump(exclude_none=True) == expected(name)
    for block in message.content:
        if block.type == "tool_use":
            assert isinstance(block.input, dict)


@pytest.mark.parametrize("name", FAILED)
def test_error_event_raises_api_status_error(client: anthropic.Anthropic, name: str) -> None:
    last = SCENARIOS[name]()[-1]
    assert isinstance(last, Error)
    with (
        pytest.raises(anthropic.APIStatusError) as raised,
        client.messages.stream(**request(name)) as stream,
    ):
        stream.get_final_message()
    assert last.message in str(raised.value)
    assert isinstance(raised.value.body, dict)
    cancelled = "invalid_request_error" if last.kind == "cancelled" else None  # the client's doing
    assert raised.value.body["error"]["type"] in {"api_error", "overloaded_error", cancelled}


def test_beta_stream_helper_accumulates_thinking_and_tool_use(client: anthropic.Anthropic) -> None:
    with client.beta.messages.stream(**request("reasoning_tool_call")) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "tool_use"]
    thinking, tool = final.content
    assert thinking.type == "thinking" and thinking.thinking == "Need the weather."
    assert tool.type == "tool_use" and tool.input == {"city": "Paris"} and tool.id == "toolu_a1"
    assert final.stop_reason == "tool_use"
