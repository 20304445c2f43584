"""``/v1/chat/completions`` through the real torch engine with the reasoning/tool test model.

The model is ``ForcedSequenceModel`` (logits that force a token script) behind the real tokenizer
with reasoning and tool markers, the real chat template, the engine's decoder (reasoning router,
tool-call parser) and a real worker, API and Redis; only the choice of tokens is fixed. So this
checks that a marker-level reasoning block and a Hermes tool call reach the openai SDK intact.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec
import openai
import pytest
import redis.asyncio as aioredis
import torch
from openai.types.chat import ChatCompletion

from services.api.wire.openai_chat import Context as ChatContext, render
from services.worker.main import start_worker
from services.worker.torch_backend import TorchBackend
from shared import keys
from shared.accumulate import fold
from shared.codec import decode_entries
from shared.config import Settings
from tests.forced_model import forced_backend as forced_model_backend
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

SCRIPT = (
    '<think>Need the weather.</think><tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}</tool_call><|im_end|>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def forced_backend() -> TorchBackend:
    """The engine over a model that always writes ``SCRIPT``."""
    torch.set_num_threads(1)
    return forced_model_backend(SCRIPT, context=512)


@pytest.fixture
async def client(
    api: str, redis_url: str, redis: aioredis.Redis
) -> AsyncIterator[openai.AsyncOpenAI]:
    """The SDK against the live API, with a worker serving the forced model behind it."""
    settings = Settings.from_env({}, redis_url=redis_url, lease_ttl_s=10.0, heartbeat_s=0.5)
    worker = await start_worker(settings, forced_backend())
    try:
        async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as c:
            yield c
    finally:
        await worker.stop(0.5)


async def rendered(
    redis: aioredis.Redis, completion: ChatCompletion, shown: bool
) -> ChatCompletion:
    """``render(fold(events))`` of the events the worker published for ``completion``."""
    events = decode_entries(await redis.xrange(keys.events(completion.id)))
    check_stream(events)
    ctx = ChatContext(
        id=completion.id, created=completion.created, model="forced", include_reasoning=shown
    )
    return ChatCompletion.model_validate_json(msgspec.json.encode(render(fold(events), ctx)))


def calls(completion: ChatCompletion) -> list[tuple[str, str, str]]:
    return [
        (c.id, c.function.name, c.function.arguments)
        for c in completion.choices[0].message.tool_calls or []
        if c.type == "function"
    ]


def check_tool_call(completion: ChatCompletion) -> None:
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    assert calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


async def test_reasoning_and_tool_call_reach_the_sdk(
    client: openai.AsyncOpenAI, redis: aioredis.Redis
) -> None:
    common = {"model": "forced", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 100}
    async with client.chat.completions.stream(
        **common,  # type: ignore[arg-type]
        extra_headers={"X-Include-Reasoning": "true"},
        stream_options={"include_usage": True},
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_completion()
    check_tool_call(final)
    assert (final.choices[0].message.model_extra or {}).get("reasoning_content") == (
        "Need the weather."
    )
    assert "tool_calls.function.arguments.done" in kinds
    assert final.usage is not None and final.usage.completion_tokens > 0
    want = await rendered(redis, final, shown=True)
    assert calls(final) == calls(want)
    assert final.usage == want.usage

    done = await client.chat.completions.create(**common)  # type: ignore[call-overload]
    check_tool_call(done)
    assert "reasoning_content" not in (done.choices[0].message.model_extra or {})
    assert done.model_dump() == (await rendered(redis, done, shown=False)).model_dump()
