"""Anthropic Messages and OpenAI Responses through the real engine with the marker test model.

The same forced script as ``test_chat_forced_model`` (a ``<think>`` block, then a Hermes tool call)
runs through the real tokenizer, template, decoder, worker, Redis and API; the official SDKs'
stream helpers must rebuild a thinking/reasoning block followed by one tool call, and agree with
the non-streaming answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
import redis.asyncio as aioredis

from services.worker.main import start_worker
from shared import keys
from shared.codec import decode_entries
from shared.config import Settings
from tests.integration.test_chat_forced_model import forced_backend
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

WEATHER = {
    "name": "get_weather",
    "description": "Current weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
async def forced_worker(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[None]:
    settings = Settings.from_env({}, redis_url=redis_url, lease_ttl_s=10.0, heartbeat_s=0.5)
    worker = await start_worker(settings, forced_backend())
    try:
        yield
    finally:
        await worker.stop(0.5)


async def stored_events_ok(redis: aioredis.Redis, rid: str) -> None:
    check_stream(decode_entries(await redis.xrange(keys.events(rid))))


async def test_anthropic_thinking_then_tool_use(
    api: str, forced_worker: None, redis: aioredis.Redis
) -> None:
    async with anthropic.AsyncAnthropic(base_url=api, api_key="k", max_retries=0) as client:
        common = {
            "model": "forced",
            "max_tokens": 100,
            "tools": [WEATHER],
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
        async with client.messages.stream(**common) as stream:  # type: ignore[arg-type]
            final = await stream.get_final_message()
        plain = await client.messages.create(**common)  # type: ignore[arg-type]
    for message in (final, plain):
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["thinking", "tool_use"]
        thinking, call = message.content
        assert thinking.type == "thinking" and thinking.thinking == "Need the weather."
        assert call.type == "tool_use" and call.name == "get_weather"
        assert call.input == {"city": "Paris"} and call.id.startswith("toolu_")
        await stored_events_ok(redis, message.id)
    assert final.usage.output_tokens == plain.usage.output_tokens


async def test_responses_reasoning_then_function_call(
    api: str, forced_worker: None, redis: aioredis.Redis
) -> None:
    # strict false: the forced double writes its scripted token ids, which a grammar's mask
    # need not allow, and this test is about the items a call projects to (constrained
    # arguments have the structured-output suites).
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER["input_schema"],
        "strict": False,
    }
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        common = {
            "model": "forced",
            "input": "Weather in Paris?",
            "tools": [tool],
            "max_output_tokens": 100,
            "reasoning": {"effort": "medium"},
        }
        async with client.responses.stream(**common) as stream:  # type: ignore[arg-type]
            final = await stream.get_final_response()
        plain = await client.responses.create(**common)  # type: ignore[call-overload]
    for response in (final, plain):
        assert response.status == "completed"
        assert [item.type for item in response.output] == ["reasoning", "function_call"]
        call = response.output[1]
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and (call.id or "").startswith("fc_")
        assert response.usage is not None and response.usage.output_tokens > 0
        await stored_events_ok(redis, response.id)
    reasoning = final.output[0]
    assert reasoning.type == "reasoning"
    assert "".join(c.text for c in reasoning.content or []) == "Need the weather."
