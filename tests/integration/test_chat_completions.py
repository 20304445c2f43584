"""``/v1/chat/completions`` end to end: official openai SDK -> real uvicorn -> Redis -> worker.

The worker is the real worker with the scripted backend; ``metadata.script`` picks the scenario
per request. Parity is checked three ways for each scenario: the non-streaming response, the raw
``create(stream=True)`` chunks and the ``.stream()`` helper's final completion all agree, and the
non-streaming body equals ``render(fold(events))`` of the events actually on the Redis stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec
import openai
import pytest
import redis.asyncio as aioredis
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.api.wire.openai_chat import Context as ChatContext, render
from shared import keys
from shared.accumulate import fold
from shared.codec import decode_entries
from shared.events import AnyEvent
from tests.integration.worker_harness import WorkerHandle
from tests.invariants import check_stream
from tests.sse_frames import data_frames

pytestmark = pytest.mark.integration

MODEL = "scripted-text"
MESSAGES = [{"role": "user", "content": "hello"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
FINISHING = {
    "text": "stop",
    "reasoning": "stop",
    "tool_call": "tool_calls",
    "parallel_tool_calls": "tool_calls",
    "parameterless_tool_call": "tool_calls",
    "stop_sequence": "stop",
}


@pytest.fixture
async def client(api: str, steady_worker: WorkerHandle) -> AsyncIterator[openai.AsyncOpenAI]:
    """The async SDK against the live API, a scripted worker behind it, no retries."""
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as c:
        yield c


async def stream_events(redis: aioredis.Redis, rid: str) -> list[AnyEvent]:
    """The events the worker published for ``rid``, checked against the invariants."""
    entries = await redis.xrange(keys.events(rid))
    events = decode_entries(entries)
    check_stream(events)
    return events


def summary(completion: ChatCompletion) -> dict[str, object]:
    """Everything a client reads from a completion, except the per-request id."""
    choice = completion.choices[0]
    extra = choice.message.model_extra or {}
    return {
        "model": completion.model,
        "role": choice.message.role,
        "content": choice.message.content,
        "reasoning_content": extra.get("reasoning_content"),
        "tool_calls": [
            (c.id, c.function.name, c.function.arguments)
            for c in choice.message.tool_calls or []
            if c.type == "function"
        ],
        "finish_reason": choice.finish_reason,
        "usage": completion.usage.model_dump() if completion.usage else None,
    }


def request(script: str, **extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "metadata": {"script": script},
        **({"tools": TOOLS} if "tool" in script else {}),
        **({"stop": [", 3"]} if script == "stop_sequence" else {}),
        **extra,
    }


async def folded(redis: aioredis.Redis, completion: ChatCompletion, shown: bool) -> ChatCompletion:
    """``render(fold(events))`` of the events on the Redis stream behind ``completion``."""
    events = await stream_events(redis, completion.id)
    ctx = ChatContext(
        id=completion.id, created=completion.created, model=MODEL, include_reasoning=shown
    )
    return ChatCompletion.model_validate_json(msgspec.json.encode(render(fold(events), ctx)))


@pytest.mark.parametrize("script", list(FINISHING))
async def test_stream_and_non_stream_agree_with_the_events(
    client: openai.AsyncOpenAI, redis: aioredis.Redis, script: str
) -> None:
    shown = script == "reasoning"
    body = {"include_reasoning": True} if shown else None
    expected = await client.chat.completions.create(**request(script), extra_body=body)  # type: ignore[call-overload]
    assert expected.model_dump() == (await folded(redis, expected, shown)).model_dump()
    assert expected.choices[0].finish_reason == FINISHING[script]
    assert expected.id.startswith("chatcmpl")

    raw = await client.chat.completions.create(
        **request(script, stream=True, stream_options={"include_usage": True}), extra_body=body
    )  # type: ignore[call-overload]
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    chunks = [chunk async for chunk in raw]
    for chunk in chunks:
        state.handle_chunk(chunk)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    streamed = state.get_final_completion()
    assert summary(streamed) == summary(await folded(redis, streamed, shown))

    async with client.chat.completions.stream(**request(script), extra_body=body) as stream:  # type: ignore[arg-type]
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    want = summary(await folded(redis, final, shown))
    assert summary(final) == {**want, "usage": None}  # usage is streamed only on request
    for _, _, arguments in want["tool_calls"]:  # type: ignore[attr-defined]
        assert isinstance(json.loads(arguments), dict)
    # The same script gives the same answer whichever way it was asked for (ids aside).
    for other in (streamed, final):
        assert summary(other)["content"] == summary(expected)["content"]
        assert summary(other)["finish_reason"] == summary(expected)["finish_reason"]


async def test_reasoning_hidden_by_default_and_shown_by_header(
    client: openai.AsyncOpenAI, redis: aioredis.Redis
) -> None:
    hidden = await client.chat.completions.create(**request("reasoning"))  # type: ignore[call-overload]
    assert (hidden.choices[0].message.model_extra or {}).get("reasoning_content") is None
    assert hidden.choices[0].message.content == "Hi there! How can I help?"
    async with client.chat.completions.stream(
        **request("reasoning"),  # type: ignore[arg-type]
        extra_headers={"X-Include-Reasoning": "true"},
    ) as stream:
        final = await stream.get_final_completion()
    extra = final.choices[0].message.model_extra or {}
    assert extra["reasoning_content"] == "The user greets me. A short, friendly answer will do."
    assert final.usage is None
    events = await stream_events(redis, final.id)
    assert fold(events).reasoning == extra["reasoning_content"]


async def test_max_tokens_finishes_with_length(client: openai.AsyncOpenAI) -> None:
    done = await client.chat.completions.create(**request("text"), max_completion_tokens=3)  # type: ignore[call-overload]
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens <= 3
    async with client.chat.completions.stream(**request("text"), max_tokens=3) as stream:  # type: ignore[arg-type]
        async for _ in stream:
            pass
        with pytest.raises(openai.LengthFinishReasonError):
            await stream.get_final_completion()
        assert stream.current_completion_snapshot.choices[0].message.content == (
            done.choices[0].message.content
        )


async def test_worker_failure_mid_stream(client: openai.AsyncOpenAI, redis: aioredis.Redis) -> None:
    stream = await client.chat.completions.create(**request("error"), stream=True)  # type: ignore[call-overload]
    seen: list[str] = []

    async def drain() -> None:
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")

    with pytest.raises(openai.APIError, match="scripted failure"):
        await drain()
    assert "".join(seen) == "This answer will fail"
    with pytest.raises(openai.InternalServerError, match="scripted failure"):
        await client.chat.completions.create(**request("error"))  # type: ignore[call-overload]


async def no_request_stored(redis: aioredis.Redis) -> bool:
    """True when nothing was stored or enqueued (a rejected request leaves no trace)."""
    stored = [k async for k in redis.scan_iter(match=keys.request("*"))]
    return not stored and await redis.zcard(keys.queue(MODEL)) == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 99}, "n"),  # over SLUICE_MAX_N
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
async def test_bad_input_is_a_400_openai_error_and_nothing_is_enqueued(
    client: openai.AsyncOpenAI, redis: aioredis.Redis, body: dict[str, object], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=body)  # type: ignore[arg-type]
    err = info.value
    assert err.status_code == 400 and err.type == "invalid_request_error"
    assert isinstance(err.body, dict) and err.body["message"]
    if param is not None:
        assert err.param == param
    assert await no_request_stored(redis)


async def test_unknown_model_is_404_model_not_found(
    client: openai.AsyncOpenAI, redis: aioredis.Redis
) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="no-such-model", messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.code == "model_not_found"
    assert await no_request_stored(redis)


async def test_body_that_is_not_json_is_a_400(api: str, steady_worker: WorkerHandle) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=api) as http:
        response = await http.post(
            "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_models_lists_the_served_model_for_the_openai_sdk(
    client: openai.AsyncOpenAI,
) -> None:
    listed = [m async for m in client.models.list()]
    assert MODEL in [m.id for m in listed]
    model = await client.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    assert isinstance(model.created, int) and model.owned_by
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


async def test_retrieve_returns_the_same_completion(client: openai.AsyncOpenAI) -> None:
    done = await client.chat.completions.create(**request("tool_call"))  # type: ignore[call-overload]
    again = await client.chat.completions.retrieve(done.id)
    assert again.model_dump() == done.model_dump()
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.retrieve("chatcmpl_doesnotexist")


def completion(frames: list[tuple[str | None, str]]) -> dict[str, object]:
    """The completion the openai SDK's stream accumulator builds from chunk frames."""
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for _, data in frames:
        if data != "[DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate_json(data))
    return state.get_final_completion().model_dump()


async def test_resume_after_last_event_id_continues_without_repeating(
    api: str, steady_worker: WorkerHandle
) -> None:
    import httpx

    body = request("parallel_tool_calls", stream=True)
    async with httpx.AsyncClient(base_url=api) as http:
        first = data_frames((await http.post("/v1/chat/completions", json=body)).text)
        rid = json.loads(first[0][1])["id"]
        # The client saw frames up to the second one with an id and resumes after that id.
        cut = [i for i, (frame_id, _) in enumerate(first) if frame_id][1] + 1
        last_id = first[cut - 1][0]
        assert last_id is not None
        resumed = await http.get(
            f"/v1/chat/completions/{rid}/events", headers={"Last-Event-ID": last_id}
        )
        assert resumed.status_code == 200, resumed.text
        rest = data_frames(resumed.text)
        replay = await http.get(f"/v1/chat/completions/{rid}/events")
        again = await http.get(f"/v1/chat/completions/{rid}/events")
        bad = await http.get(f"/v1/chat/completions/{rid}/events", headers={"Last-Event-ID": "x"})
        # Dropped right after the last chunk with an id: the resume is the end at once.
        final_id = [i for i, _ in first if i][-1]
        after_end = await http.get(
            f"/v1/chat/completions/{rid}/events", headers={"Last-Event-ID": final_id}, timeout=5
        )
    assert data_frames(after_end.text) == [(None, "[DONE]")]
    # Frame boundaries may differ (a backlog's deltas fold into fewer chunks: the whole finished
    # log is one backlog), but nothing is lost or repeated: the resumed stream and the replay
    # accumulate to the live stream's completion, and a replay's bytes are the same every time.
    assert completion(first[:cut] + rest) == completion(first)
    assert completion(data_frames(replay.text)) == completion(first)
    assert replay.content == again.content

    def key(entry_id: str) -> tuple[int, ...]:
        return tuple(int(part) for part in entry_id.split("-"))

    assert all(key(i) > key(last_id) for i, _ in rest if i is not None)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    # Replayed through the SDK's accumulator, the resumed stream is one clean completion.
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for _, data in first[:cut] + rest:
        if data != "[DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate_json(data))
    final = state.get_final_completion()
    assert final.choices[0].message.role == "assistant"
    assert [c.id for c in final.choices[0].message.tool_calls or []] == [
        json.loads(d)["choices"][0]["delta"]["tool_calls"][0]["id"]
        for _, d in first
        if '"type":"function"' in d
    ]


async def test_reasoning_format_inline_through_the_sdk(
    client: openai.AsyncOpenAI, redis: aioredis.Redis
) -> None:
    """``reasoning_format: "inline"``: the reasoning is in ``content`` between the model's own
    markers (from its card), streamed, not streamed and replayed alike, and in no other field."""
    body = {"reasoning_format": "inline"}
    done = await client.chat.completions.create(**request("reasoning"), extra_body=body)  # type: ignore[call-overload]
    events = await stream_events(redis, done.id)
    folded_events = fold(events)
    think = f"<think>{folded_events.reasoning}</think>"
    assert done.choices[0].message.content == think + folded_events.text
    assert summary(done)["reasoning_content"] is None

    raw = await client.chat.completions.create(**request("reasoning", stream=True), extra_body=body)  # type: ignore[call-overload]
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    async for chunk in raw:
        state.handle_chunk(chunk)
    streamed = state.get_final_completion()
    assert streamed.choices[0].message.content == done.choices[0].message.content
    assert summary(streamed)["reasoning_content"] is None

    replayed = await client.chat.completions.retrieve(done.id)
    assert replayed.choices[0].message.content == done.choices[0].message.content
