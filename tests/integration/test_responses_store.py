"""Stored responses end to end: previous_response_id, GET (and re-stream), DELETE, cancel, owners.

Everything lives in Redis, so a second API replica (another uvicorn on the same database) serves
what the first one created. The rebuilt conversation is asserted on the job the API stored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from services.queue import arq_keys
from shared import keys
from shared.codec import decode_job
from shared.config import Settings
from shared.jobs import GenerateRequest, Message, TextPart, ToolCall
from tests.integration.server_harness import running_api
from tests.integration.test_responses_api import MODEL, TOOLS, request, stream_events
from tests.integration.worker_harness import WorkerHandle, running_worker

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "key-a", "key-b"
QUESTION = "What is the weather in Paris?"


@pytest.fixture
async def replicas(redis_url: str, steady_worker: WorkerHandle) -> AsyncIterator[tuple[str, str]]:
    """Two API replicas on the same Redis database, with two API keys configured."""
    settings = Settings(redis_url=redis_url, keepalive_s=0.5, api_keys=[KEY_A, KEY_B])
    async with running_api(settings) as one, running_api(settings) as two:
        yield one, two


def sdk(base_url: str, key: str = KEY_A) -> openai.AsyncOpenAI:
    """The async SDK for one replica and key, no retries."""
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)


async def stored_job(redis: aioredis.Redis, rid: str) -> GenerateRequest:
    """The job the API stored (and enqueued) for ``rid``."""
    payload = await redis.hget(keys.request(rid), "job")  # type: ignore[misc]
    assert payload is not None
    return decode_job(payload)


def text(role: str, body: str) -> Message:
    return Message(role=role, content=[TextPart(text=body)])  # type: ignore[arg-type]


async def test_previous_response_id_rebuilds_tool_loop_on_another_replica(
    replicas: tuple[str, str], redis: aioredis.Redis
) -> None:
    one, two = replicas
    async with sdk(one) as first, sdk(two) as second:
        r1 = await first.responses.create(**request("tool_call"))  # type: ignore[call-overload]
        (call,) = [item for item in r1.output if item.type == "function_call"]
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
        r2 = await second.responses.create(
            model=MODEL,
            previous_response_id=r1.id,
            input=[output],  # type: ignore[list-item]
            instructions="Second turn rules.",
            tools=TOOLS,  # type: ignore[arg-type]
            metadata={"script": "text"},
        )
        assert r2.status == "completed" and r2.previous_response_id == r1.id
        calls = [ToolCall(id=call.call_id, name="get_weather", arguments=call.arguments)]
        expected = [
            text("system", "Second turn rules."),  # the first turn's instructions do not carry
            text("user", QUESTION),
            Message(role="assistant", tool_calls=calls),
            Message(
                role="tool",
                content=[TextPart(text="18 C")],
                tool_call_id=call.call_id,
                name="get_weather",
            ),
        ]
        assert (await stored_job(redis, r2.id)).messages == expected

        r3 = await first.responses.create(
            model=MODEL, previous_response_id=r2.id, input="Thanks!", metadata={"script": "echo"}
        )
        assert r3.output_text == "Thanks!"
        assert (await stored_job(redis, r3.id)).messages == [
            *expected[1:],
            text("assistant", r2.output_text),
            text("user", "Thanks!"),
        ]

        # Replaying the full input instead of chaining builds the same conversation.
        # Another server's reasoning item (opaque encrypted_content only) is accepted, ignored.
        foreign = {"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": "gAAA"}
        replay = [
            {"role": "user", "content": QUESTION},
            foreign,
            *[item.model_dump(exclude_none=True) for item in r1.output],
            output,
        ]
        r4 = await second.responses.create(
            model=MODEL,
            input=replay,
            instructions="Second turn rules.",
            tools=TOOLS,  # type: ignore[arg-type]
            metadata={"script": "text"},
        )
        assert (await stored_job(redis, r4.id)).messages == expected


async def test_get_delete_and_owner_isolation(
    replicas: tuple[str, str], redis: aioredis.Redis
) -> None:
    one, two = replicas
    async with sdk(one) as owner, sdk(two) as same_owner, sdk(one, KEY_B) as stranger:
        created = await owner.responses.create(**request("reasoning"))  # type: ignore[call-overload]
        got = await same_owner.responses.retrieve(created.id)
        assert got.model_dump() == created.model_dump()
        for call in (
            stranger.responses.retrieve(created.id),
            stranger.responses.delete(created.id),
            stranger.responses.cancel(created.id),
            stranger.responses.create(
                model=MODEL, previous_response_id=created.id, input="x", metadata={"script": "text"}
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        assert (await same_owner.responses.retrieve(created.id)).id == created.id

        await same_owner.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            await owner.responses.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            await owner.responses.create(
                model=MODEL, previous_response_id=created.id, input="x", metadata={"script": "text"}
            )
        assert not await redis.exists(keys.events(created.id), keys.request(created.id))
        assert not await redis.exists(arq_keys.result(created.id))  # no copy of the prompt left

        unstored = await owner.responses.create(**request("text"), store=False)  # type: ignore[call-overload]
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await owner.responses.retrieve(unstored.id)


async def _sse(http: httpx.AsyncClient, method: str, url: str, **kw: object) -> list[dict]:  # type: ignore[type-arg]
    out = []
    async with http.stream(method, url, **kw) as response:  # type: ignore[arg-type]
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
    return out


async def test_get_stream_replays_from_the_event_log(
    replicas: tuple[str, str], redis: aioredis.Redis
) -> None:
    one, two = replicas
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        body = {**request("parallel_tool_calls"), "stream": True}
        original = await _sse(http, "POST", f"{one}/v1/responses", json=body)
        rid = original[0]["response"]["id"]
        await stream_events(redis, rid)
        url = f"{two}/v1/responses/{rid}"
        assert await _sse(http, "GET", url, params={"stream": "true"}) == original
        for after in (0, 4, len(original) - 2):
            params = {"stream": "true", "starting_after": str(after)}
            assert await _sse(http, "GET", url, params=params) == original[after + 1 :]
        stored = (await http.get(url)).json()
        assert stored == original[-1]["response"]


async def test_cancel_stops_an_in_flight_response(
    redis_url: str, replicas: tuple[str, str], redis: aioredis.Redis
) -> None:
    one, two = replicas
    overrides = {"lease_ttl_s": 10.0, "heartbeat_s": 0.5}
    async with (
        running_worker(redis_url, "scripted:long?rate=200", overrides, name="slow") as slow,
        sdk(one) as client,
        sdk(two) as other,
    ):
        stream = await client.responses.create(
            model=slow.name, input="go", stream=True, metadata={"script": "long"}
        )
        kinds: list[str] = []
        rid = ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.created":
                rid = event.response.id
            if event.type == "response.output_text.delta" and kinds.count(event.type) == 1:
                cancelled = await other.responses.cancel(rid)
                assert cancelled.status == "cancelled"
        assert kinds[-1] == "response.incomplete"
        assert event.type == "response.incomplete"
        assert event.response.status == "cancelled"
        assert (await other.responses.retrieve(rid)).status == "cancelled"
        with pytest.raises(openai.BadRequestError):
            await other.responses.cancel(rid)
        events = await stream_events(redis, rid)
        assert events[-1].reason == "cancelled"  # type: ignore[union-attr]


async def test_background_response_is_polled_with_get(
    replicas: tuple[str, str], redis: aioredis.Redis
) -> None:
    one, two = replicas
    async with sdk(one) as client, sdk(two) as other:
        queued = await client.responses.create(**request("reasoning"), background=True)  # type: ignore[call-overload]
        assert (queued.status, queued.background, queued.output) == ("queued", True, [])
        # GET ?stream=true follows the event log to its end, from any replica.
        stream = await other.responses.retrieve(queued.id, stream=True)
        kinds = [event.type async for event in stream]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        done = await other.responses.retrieve(queued.id)
        assert (done.status, done.background) == ("completed", True)
        assert done.output_text == "Hi there! How can I help?"
        await stream_events(redis, queued.id)


async def test_leaving_a_get_stream_does_not_cancel_a_background_response(
    redis_url: str, replicas: tuple[str, str], redis: aioredis.Redis
) -> None:
    one, two = replicas
    overrides = {"lease_ttl_s": 10.0, "heartbeat_s": 0.5}
    async with (
        running_worker(redis_url, "scripted:long?rate=400", overrides, name="slow") as slow,
        sdk(one) as client,
        sdk(two) as other,
    ):
        queued = await client.responses.create(
            model=slow.name,
            input="go",
            background=True,
            max_output_tokens=400,  # about a second at this rate
            metadata={"script": "long"},
        )
        stream = await other.responses.retrieve(queued.id, stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta":
                break  # the observer leaves mid-generation
        await stream.close()
        follow = await client.responses.retrieve(queued.id, stream=True)
        last = [event async for event in follow][-1]
        assert last.type == "response.incomplete"
        assert last.response.status == "incomplete"  # ran to its limit, not "cancelled"
        assert not await redis.exists(keys.cancel(queued.id))
        events = await stream_events(redis, queued.id)
        assert events[-1].reason == "max_tokens"  # type: ignore[union-attr]
