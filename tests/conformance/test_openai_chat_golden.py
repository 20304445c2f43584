"""The openai SDK parses every golden Chat Completions transcript, served over real HTTP.

A tiny Starlette app on a real uvicorn server returns the golden bytes for streaming requests and
``render(fold(events))`` for non-streaming ones, picked by ``metadata.golden``. Parity: the SDK's
stream helper reconstructs exactly the non-streaming response from the same events.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import msgspec
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion
from starlette.requests import Request
from starlette.responses import Response

from services.api.wire.common import service_error as error_from_event
from services.api.wire.openai_chat import render
from services.api.wire.openai_errors import error_body as openai_error_body
from services.api.wire.sse import comment
from shared.accumulate import fold
from shared.events import Error
from tests.conformance.transcript_server import serve_post
from tests.factories import SCENARIOS
from tests.golden.test_openai_chat import GOLDEN_DIR, context, golden_cases
from tests.invariants import check_stream

CASES = {c[0]: c for c in golden_cases()}
FAILED = [stem for stem, name, _, _ in CASES.values() if isinstance(SCENARIOS[name]()[-1], Error)]
FINISHED = [stem for stem in CASES if stem not in FAILED]


async def _completions(request: Request) -> Response:
    body = json.loads(await request.body())
    stem, scenario, usage, shown = CASES[body["metadata"]["golden"]]
    if body.get("stream"):
        data = (GOLDEN_DIR / f"{stem}.sse").read_bytes()
        if body["metadata"].get("keepalive"):
            data = _with_ids_and_keepalives(data)
        return Response(data, media_type="text/event-stream; charset=utf-8")
    events = SCENARIOS[scenario]()
    check_stream(events)
    completion = fold(events)
    if completion.error is not None:
        status, err = openai_error_body(error_from_event(completion.error))
        return Response(json.dumps(err), status_code=status, media_type="application/json")
    ctx = context(include_usage=usage, include_reasoning=shown)
    return Response(msgspec.json.encode(render(completion, ctx)), media_type="application/json")


def _with_ids_and_keepalives(data: bytes) -> bytes:
    """What the pipeline sends on a slow stream: ``id:`` on events, keepalives in between."""
    events = data.split(b"\n\n")[:-1]
    return b"".join(
        b"id: %d-0\n" % i + event + b"\n\n" + comment() for i, event in enumerate(events)
    )


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A real uvicorn server in a thread, serving the golden transcripts."""
    with serve_post("/v1/chat/completions", _completions) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """The official SDK client, no retries (a retry would hide a failure)."""
    with openai.OpenAI(base_url=base_url, api_key="test", max_retries=0) as c:
        yield c


def _request(stem: str) -> dict[str, object]:
    _, _, usage, _ = CASES[stem]
    return {
        "model": "tiny-test",
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"golden": stem},
        **({"stream_options": {"include_usage": True}} if usage else {}),
    }


def _summary(completion: ChatCompletion) -> dict[str, object]:
    """The fields a client consumes, in comparable form."""
    choice = completion.choices[0]
    message = choice.message
    extra = message.model_extra or {}
    return {
        "id": completion.id,
        "model": completion.model,
        "role": message.role,
        "content": message.content,
        "reasoning_content": extra.get("reasoning_content"),
        "tool_calls": [
            (c.id, c.type, c.function.name, c.function.arguments)
            for c in message.tool_calls or []
            if c.type == "function"
        ],
        "finish_reason": choice.finish_reason,
        "usage": completion.usage.model_dump() if completion.usage else None,
    }


@pytest.mark.parametrize("stem", FINISHED)
def test_stream_helper_reconstructs_the_non_streaming_response(
    client: openai.OpenAI, stem: str
) -> None:
    _, scenario, usage, _ = CASES[stem]
    expected = client.chat.completions.create(**_request(stem))  # type: ignore[call-overload]
    with client.chat.completions.stream(**_request(stem)) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        if scenario == "max_tokens":
            # The helper raises on "length" by design; the snapshot still holds the answer.
            with pytest.raises(openai.LengthFinishReasonError):
                stream.get_final_completion()
            streamed: ChatCompletion = stream.current_completion_snapshot
        else:
            streamed = stream.get_final_completion()
    want = _summary(expected)
    if not usage:
        want["usage"] = None  # usage is streamed only on request
    assert _summary(streamed) == want
    assert "chunk" in kinds
    for _, _, _, arguments in want["tool_calls"]:  # type: ignore[attr-defined]
        assert isinstance(json.loads(arguments), dict)
    if want["tool_calls"]:
        assert "tool_calls.function.arguments.done" in kinds


@pytest.mark.parametrize("stem", FINISHED)
def test_raw_stream_chunks_follow_the_chat_rules(client: openai.OpenAI, stem: str) -> None:
    _, _, usage, _ = CASES[stem]
    chunks = list(client.chat.completions.create(stream=True, **_request(stem)))  # type: ignore[call-overload]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] is not None and all(f is None for f in finishes[:-1])
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    snapshot = state.current_completion_snapshot
    if usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert all(c.usage is None for c in chunks[:-1])
        assert snapshot.usage is not None and snapshot.usage.prompt_tokens_details is not None
    else:
        assert all(c.usage is None for c in chunks)


@pytest.mark.parametrize("stem", FAILED)
def test_in_band_error_raises_api_error(client: openai.OpenAI, stem: str) -> None:
    _, scenario, _, _ = CASES[stem]
    error = SCENARIOS[scenario]()[-1]
    assert isinstance(error, Error)
    with pytest.raises(openai.APIError) as info:
        for _ in client.chat.completions.create(stream=True, **_request(stem)):  # type: ignore[call-overload]
            pass
    assert info.value.message == error.message
    # sluice's retryable rides inside the error object, which the SDK keeps as APIError.body
    assert isinstance(info.value.body, dict) and info.value.body["retryable"] is error.retryable
    with (
        pytest.raises(openai.APIError, match=r"device-side|no worker|cancelled"),
        client.chat.completions.stream(**_request(stem)) as stream,  # type: ignore[arg-type]
    ):
        stream.get_final_completion()


@pytest.mark.parametrize("stem", ["text.usage", "parallel_tool_calls"])
def test_keepalives_after_event_ids_are_invisible_to_the_sdk(
    client: openai.OpenAI, stem: str
) -> None:
    # The SDK keeps the last id: across events; a keepalive must not look like an empty event.
    request = _request(stem)
    plain = client.chat.completions.create(stream=True, **request)  # type: ignore[call-overload]
    request["metadata"] = {"golden": stem, "keepalive": "1"}
    with client.chat.completions.stream(**request) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for chunk in plain:
        state.handle_chunk(chunk)
    assert _summary(final) == _summary(state.get_final_completion())
