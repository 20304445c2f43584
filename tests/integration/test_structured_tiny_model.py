"""Forced tool calls in the model's own Hermes syntax, through the three official SDKs.

A tiny random-weight Qwen3 (``<tool_call>`` marker tokens, so the card names the Hermes style)
served by the real worker: whatever it writes is noise, so a call whose arguments validate is
the grammar's doing. Streamed and not; the stored streams keep the invariants.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
import redis.asyncio as aioredis

from services.worker.loaders import load_model
from services.worker.main import start_worker
from services.worker.torch_backend import TorchBackend
from shared import keys
from shared.codec import decode_entries
from shared.config import Settings
from tests.invariants import check_stream
from tests.worker_models import write_hf_model

pytestmark = pytest.mark.integration

MODEL = "tiny-hermes"
SCHEMA = {
    "type": "object",
    # both bounds: with "maximum" alone, any negative integer is valid, and noise can write one
    # digit after another until max_tokens (seen: -123001863262237909444545)
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture
async def tiny_worker(redis_url: str, redis: aioredis.Redis, tmp_path: Path) -> AsyncIterator[None]:
    write_hf_model(tmp_path / MODEL, "Qwen3ForCausalLM", seed=5, max_position_embeddings=1024)
    loaded = load_model(str(tmp_path / MODEL), device="cpu")
    assert loaded.card.tools is not None and loaded.card.tools.style == "hermes"
    settings = Settings.from_env({}, redis_url=redis_url, lease_ttl_s=10.0, heartbeat_s=0.5)
    worker = await start_worker(settings, TorchBackend(loaded, max_batch=4))
    try:
        yield
    finally:
        await worker.stop(0.5)


async def stored_ok(redis: aioredis.Redis, rid: str) -> None:
    check_stream(decode_entries(await redis.xrange(keys.events(rid))))


async def test_openai_chat_and_responses_forced_calls(
    api: str, tiny_worker: None, redis: aioredis.Redis
) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        # One call each: a random model would otherwise go on adding parallel calls to the end.
        common = {
            "model": MODEL,
            "messages": ASK,
            "tools": [tool],
            "max_tokens": 150,
            "parallel_tool_calls": False,
        }
        for seed, choice in enumerate(
            ["required", {"type": "function", "function": {"name": "get_weather"}}]
        ):
            done = await client.chat.completions.create(
                **common, tool_choice=choice, temperature=1.0, seed=seed
            )  # type: ignore[call-overload]
            calls = done.choices[0].message.tool_calls or []
            assert done.choices[0].finish_reason == "tool_calls" and calls
            jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA)
            await stored_ok(redis, done.id)
        stream = await client.chat.completions.create(
            **common, tool_choice="required", temperature=1.0, seed=7, stream=True
        )  # type: ignore[call-overload]
        args = "".join(
            [
                c.choices[0].delta.tool_calls[0].function.arguments or ""
                async for c in stream
                if c.choices and c.choices[0].delta.tool_calls
            ]
        )
        jsonschema.validate(json.loads(args), SCHEMA)
        flat = {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}
        response = await client.responses.create(
            model=MODEL,
            input="Weather in Rome?",
            tools=[flat],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            reasoning={"effort": "none"},  # a random model would think until the limit
            temperature=1.0,
            max_output_tokens=150,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


async def test_anthropic_tool_choice_any_and_tool(
    api: str, tiny_worker: None, redis: aioredis.Redis
) -> None:
    weather = {"name": "get_weather", "input_schema": SCHEMA}
    async with anthropic.AsyncAnthropic(base_url=api, api_key="k", max_retries=0) as client:
        common = {
            "model": MODEL,
            "max_tokens": 150,
            "messages": ASK,
            "tools": [weather],
            "thinking": {"type": "disabled"},
        }
        # one call each: with parallel calls allowed, noise may open call after call until
        # max_tokens cuts one off (the grammar lets it; only this test's stop_reason minds)
        one = {"disable_parallel_tool_use": True}
        for choice in ({"type": "any", **one}, {"type": "tool", "name": "get_weather", **one}):
            used = await client.messages.create(**common, tool_choice=choice)  # type: ignore[call-overload]
            blocks = [b for b in used.content if b.type == "tool_use"]
            assert used.stop_reason == "tool_use" and blocks
            jsonschema.validate(blocks[0].input, SCHEMA)
            await stored_ok(redis, used.id)
        async with client.messages.stream(**common, tool_choice={"type": "any", **one}) as stream:  # type: ignore[arg-type]
            final = await stream.get_final_message()
        blocks = [b for b in final.content if b.type == "tool_use"]
        assert blocks and final.stop_reason == "tool_use"
        jsonschema.validate(blocks[0].input, SCHEMA)
