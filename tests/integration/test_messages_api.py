"""``/v1/messages`` end to end: official anthropic SDK -> real uvicorn -> Redis -> scripted worker.

``metadata.script`` picks the worker's scenario per request (the SDK passes extra metadata keys
through). For every scenario the non-streaming message, the SDK stream helper's final message and
a raw stream read by the strict (Claude Code-style) consumer each equal ``render(fold(events))``
of the events actually on that request's Redis stream.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import msgspec
import pytest
import redis.asyncio as aioredis
from anthropic.types import Message

from services.api.wire.anthropic_messages import Context as MessageContext, render
from services.api.wire.reasoning_tokens import ReasoningSigner, derive_key
from shared import keys
from shared.accumulate import fold
from shared.codec import decode_entries, decode_job
from shared.config import Settings
from shared.events import AnyEvent, Start
from shared.jobs import GenerateRequest
from tests.golden.anthropic_messages.consumer import StreamFailed, parse_sse, strict_consume
from tests.integration.server_harness import running_api
from tests.integration.worker_harness import running_worker
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

MODEL = "scripted-text"
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
STOP_REASONS = {
    "text": ("end_turn", None),
    "reasoning": ("end_turn", None),
    "tool_call": ("tool_use", None),
    "parallel_tool_calls": ("tool_use", None),
    "parameterless_tool_call": ("tool_use", None),
    "stop_sequence": ("stop_sequence", ", 3"),
    "max_tokens": ("max_tokens", None),
}


# A slow sweep: with the harness's 0.1 s sweep, a request caught between the API's inflight
# write and its enqueue is "recovered" as lost and generated twice (reported to the lead).
CALM = {"heartbeat_s": 1.0, "lease_ttl_s": 5.0}


@pytest.fixture
async def worker(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[object]:
    """The scripted worker (no token delay) with a calm recovery sweep."""
    async with running_worker(redis_url, "scripted:text?rate=0", CALM) as handle:
        yield handle


@pytest.fixture
async def client(api: str, worker: object) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The async SDK (the worker runs on this loop) against the live API, no retries."""
    async with anthropic.AsyncAnthropic(base_url=api, api_key="k", max_retries=0) as c:
        yield c


def request(script: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 3 if script == "max_tokens" else 256,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "hello"}],
        "metadata": {"user_id": "u-1", "script": "text" if script == "max_tokens" else script},
    }
    if "tool" in script:
        body["tools"] = TOOLS
    if script == "stop_sequence":
        body["stop_sequences"] = [", 3"]
    if script == "reasoning":
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    return {**body, **extra}


async def stream_events(redis: aioredis.Redis, rid: str) -> list[AnyEvent]:
    """The events the worker published for ``rid``, checked against the invariants."""
    events = decode_entries(await redis.xrange(keys.events(rid)))
    check_stream(events)
    return events


async def signer(redis: aioredis.Redis) -> ReasoningSigner:
    """The deployment's signer, from the secret the API generated into Redis."""
    secret = await redis.get(keys.reasoning_secret())
    assert isinstance(secret, bytes)
    return ReasoningSigner(derive_key(secret))


async def rendered(redis: aioredis.Redis, rid: str) -> dict[str, Any]:
    """``render(fold(events))`` of the events on the Redis stream of ``rid``, as JSON."""
    events = await stream_events(redis, rid)
    ctx = MessageContext(message_id=rid, model=MODEL, signer=await signer(redis))
    message = render(fold(events), ctx)
    return msgspec.json.decode(msgspec.json.encode(message), type=dict[str, Any])


async def stored_job(redis: aioredis.Redis, rid: str) -> GenerateRequest:
    """The job the API stored (and enqueued) for ``rid``."""
    pending: Any = redis.hget(keys.request(rid), "job")  # redis-py's stubs mix sync and async
    return decode_job(await pending)


def dump(message: Message) -> dict[str, Any]:
    return Message.model_validate(message.model_dump()).model_dump(exclude_none=True)


@pytest.mark.parametrize("script", list(STOP_REASONS))
async def test_stream_and_non_stream_agree_with_the_events(
    client: anthropic.AsyncAnthropic, redis: aioredis.Redis, api: str, script: str
) -> None:
    message = await client.messages.create(**request(script))
    assert message.id.startswith("msg_")
    assert dump(message) == dump(Message.model_validate(await rendered(redis, message.id)))
    assert (message.stop_reason, message.stop_sequence) == STOP_REASONS[script]

    async with client.messages.stream(**request(script)) as stream:
        final = await stream.get_final_message()
    assert dump(final) == dump(Message.model_validate(await rendered(redis, final.id)))

    # Claude Code's way in: x-api-key, ?beta=true, betas we do not know, a future version.
    headers = {
        "x-api-key": "k",
        "anthropic-version": "2099-01-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,made-up-beta",
    }
    async with (
        httpx.AsyncClient(base_url=api) as http,
        http.stream(
            "POST", "/v1/messages?beta=true", json=request(script, stream=True), headers=headers
        ) as response,
    ):
        raw = await response.aread()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    rid = response.headers["request-id"]
    assert strict_consume(parse_sse(raw)) == await rendered(redis, rid)

    # Same script, same answer, whichever way it was asked for (ids aside).
    for other in (final, Message.model_validate(strict_consume(parse_sse(raw)))):
        assert [b.type for b in other.content] == [b.type for b in message.content]
        assert other.usage == message.usage
    if script == "reasoning":
        assert [b.type for b in message.content] == ["thinking", "text"]
    if script == "max_tokens":
        assert message.usage.output_tokens <= 3


async def test_tool_input_is_an_object_and_ids_are_toolu(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.create(**request("parallel_tool_calls"))
    calls = [b for b in message.content if b.type == "tool_use"]
    assert [c.input for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c.id.startswith("toolu_") for c in calls)
    assert len({c.id for c in calls}) == 2


async def test_multi_turn_tool_loop_replays_thinking_and_tool_use(
    client: anthropic.AsyncAnthropic, redis: aioredis.Redis
) -> None:
    thought = await client.messages.create(**request("reasoning"))
    called = await client.messages.create(**request("tool_call"))
    assert called.stop_reason == "tool_use"
    tool_use = next(b for b in called.content if b.type == "tool_use")
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [b.model_dump() for b in thought.content]},
        {"role": "user", "content": "and the weather?"},
        {"role": "assistant", "content": [b.model_dump() for b in called.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": tool_use.id, "content": "21C and sunny"}
            ],
        },
    ]
    done = await client.messages.create(**request("text", messages=history, tools=TOOLS))
    assert done.stop_reason == "end_turn"
    job = await stored_job(redis, done.id)
    roles = [m.role for m in job.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "tool"]
    replayed = job.messages[2]
    thinking = next(b for b in thought.content if b.type == "thinking")
    assert replayed.reasoning == thinking.thinking
    call = job.messages[4].tool_calls[0]
    assert (call.id, call.name, msgspec.json.decode(call.arguments)) == (
        tool_use.id,
        "get_weather",
        {"city": "Paris"},
    )
    assert job.messages[5].tool_call_id == tool_use.id
    assert job.messages[5].text == "21C and sunny"


async def test_count_tokens_equals_the_prompt_tokens_charged(
    client: anthropic.AsyncAnthropic, redis: aioredis.Redis
) -> None:
    body = request("tool_call")
    counted = await client.messages.count_tokens(
        model=body["model"], system=body["system"], messages=body["messages"], tools=body["tools"]
    )
    message = await client.messages.create(**body)
    start = (await stream_events(redis, message.id))[0]
    assert isinstance(start, Start)
    assert counted.input_tokens == start.prompt_tokens > 0
    usage = message.usage
    total = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == total
    stored = await stored_job(redis, message.id)
    assert counted.input_tokens == len(stored.prompt_token_ids or [])
    # Thinking and tools change the rendered prompt, and count_tokens sees the same template.
    bare = await client.messages.count_tokens(model=MODEL, messages=body["messages"])
    assert bare.input_tokens < counted.input_tokens


async def test_mid_stream_failure_is_an_error_event_and_a_500(
    client: anthropic.AsyncAnthropic, redis: aioredis.Redis, api: str
) -> None:
    with pytest.raises(anthropic.APIStatusError, match="scripted failure") as info:
        async with client.messages.stream(**request("error")) as stream:
            await stream.get_final_message()
    assert isinstance(info.value.body, dict) and info.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.InternalServerError, match="scripted failure") as failed:
        await client.messages.create(**request("error"))
    assert failed.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": failed.value.body["error"]["message"]},  # type: ignore[index]
    }
    async with httpx.AsyncClient(base_url=api) as http:
        response = await http.post("/v1/messages", json=request("error", stream=True))
    with pytest.raises(StreamFailed) as streamed:
        strict_consume(parse_sse(response.content))
    assert streamed.value.error["type"] == "api_error"
    assert "content_block_start" in response.text  # the partial answer came first


async def test_pings_keep_a_slow_stream_alive(redis_url: str, redis: aioredis.Redis) -> None:
    settings = Settings(redis_url=redis_url, keepalive_s=0.05, lease_ttl_s=3.0)
    async with (
        running_api(settings) as base,
        running_worker(redis_url, "scripted:text?rate=40", CALM),
        httpx.AsyncClient(base_url=base) as http,
    ):
        response = await http.post("/v1/messages", json=request("text", stream=True))
    events = parse_sse(response.content)
    assert ("ping", {"type": "ping"}) in events
    message = strict_consume(events)
    assert message == await rendered(redis, response.headers["request-id"])


def frames_with_ids(raw: bytes) -> list[tuple[str | None, str | None]]:
    """``(event name, id)`` of each SSE event in ``raw`` (the pipeline puts ids on events)."""
    out: list[tuple[str | None, str | None]] = []
    for chunk in raw.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in chunk.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields.get("event"), fields.get("id")))
    return out


async def test_replay_and_resume_after_last_event_id(
    client: anthropic.AsyncAnthropic, redis: aioredis.Redis, api: str
) -> None:
    async with httpx.AsyncClient(base_url=api) as http:
        first = await http.post("/v1/messages", json=request("reasoning", stream=True))
        rid = first.headers["request-id"]
        original = parse_sse(first.content)
        ids = frames_with_ids(first.content)
        assert [name for name, _ in ids] == [name for name, _ in original]
        # Resume after an event in the middle of the thinking block.
        cut = [i for i, (_, entry_id) in enumerate(ids) if entry_id][2]
        resumed = await http.get(
            f"/v1/messages/{rid}/events", headers={"last-event-id": str(ids[cut][1])}
        )
        # Frame boundaries may differ from the live stream's (a backlog's deltas fold into fewer
        # frames; a finished log is one backlog), never the message: nothing lost or repeated.
        resumed_events = parse_sse(resumed.content)
        whole = strict_consume(copy.deepcopy(original))  # it builds the message in place
        assert strict_consume(copy.deepcopy(original[: cut + 1]) + resumed_events) == whole
        replayed = await http.get(f"/v1/messages/{rid}/events")
        assert strict_consume(parse_sse(replayed.content)) == whole
        again = await http.get(f"/v1/messages/{rid}/events")
        assert again.content == replayed.content  # a replay's bytes are the same every time
        bad = await http.get(f"/v1/messages/{rid}/events", headers={"last-event-id": "nope"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        # After the terminal entry (it rode on message_stop) there is nothing left: closed at once.
        final_id = [entry_id for _, entry_id in ids if entry_id][-1]
        after_end = await http.get(
            f"/v1/messages/{rid}/events", headers={"last-event-id": str(final_id)}, timeout=5
        )
        assert after_end.status_code == 200 and parse_sse(after_end.content) == []
    retrieved = await client.get(f"/v1/messages/{rid}", cast_to=Message)
    assert dump(retrieved) == dump(Message.model_validate(strict_consume(original)))
    with pytest.raises(anthropic.NotFoundError):
        await client.get("/v1/messages/msg_unknown", cast_to=Message)


async def test_a_chat_completion_replays_as_an_anthropic_stream(
    api: str, worker: object, redis: aioredis.Redis
) -> None:
    async with httpx.AsyncClient(base_url=api) as http:
        chat = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "metadata": {"script": "reasoning"},
            },
        )
        assert chat.status_code == 200, chat.text
        rid = chat.json()["id"]
        replayed = await http.get(f"/v1/messages/{rid}/events")
    message = strict_consume(parse_sse(replayed.content))
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    assert message["content"][1]["text"] == chat.json()["choices"][0]["message"]["content"]
    # The chat request did not ask to see reasoning, so its replay keeps the thinking omitted;
    # the signature still holds it, so a client sending the block back restores it.
    thinking = message["content"][0]
    assert (thinking["type"], thinking["thinking"]) == ("thinking", "")
    sign = await signer(redis)
    events = await stream_events(redis, rid)
    assert sign.open(thinking["signature"], "p") == fold(events).reasoning
    hidden = MessageContext(message_id=rid, model=MODEL, show_thinking=False, signer=sign)
    assert message == msgspec.json.decode(msgspec.json.encode(render(fold(events), hidden)))
