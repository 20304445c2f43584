"""HTTP errors of ``/v1/chat/completions`` as the openai SDK sees them (no worker needed).

A published tiny card with a fake heartbeat lets the API admit requests; each test then provokes
one rejection and checks status, OpenAI error body and that nothing was stored or enqueued.
"""

from __future__ import annotations

import msgspec
import openai
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.config import Settings
from shared.model_card import ModelCard
from tests.integration.server_harness import publish_card, running_api, tiny_card

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "hello"}]


async def nothing_stored(redis: aioredis.Redis, model: str) -> bool:
    stored = [k async for k in redis.scan_iter(match=keys.request("*"))]
    return not stored and await redis.zcard(keys.queue(model)) == 0


def sdk(base_url: str, key: str = "k") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)


async def test_prompt_over_the_context_is_context_length_exceeded(
    api: str, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    long = [{"role": "user", "content": "hello " * 100}]
    async with sdk(api) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=tiny_model.name, messages=long)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded"
    assert info.value.type == "invalid_request_error"
    assert await nothing_stored(redis, tiny_model.name)


async def test_full_queue_is_429_with_retry_after(
    settings: Settings, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    async with running_api(msgspec.structs.replace(settings, queue_max=0)) as base, sdk(base) as c:
        with pytest.raises(openai.RateLimitError) as info:
            await c.chat.completions.create(model=tiny_model.name, messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.code == "rate_limit_exceeded"
    assert info.value.response.headers["retry-after"].isdigit()
    assert await nothing_stored(redis, tiny_model.name)


async def test_api_keys_are_enforced_bearer_and_x_api_key(
    settings: Settings, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    keyed = msgspec.structs.replace(settings, api_keys=["s3cret"], queue_max=0)
    async with running_api(keyed) as base:
        async with sdk(base, key="wrong") as client:
            with pytest.raises(openai.AuthenticationError) as info:
                await client.chat.completions.create(model=tiny_model.name, messages=MESSAGES)  # type: ignore[arg-type]
        assert info.value.code == "invalid_api_key"
        # The right key gets past auth (and then hits the deliberately full queue).
        async with sdk(base, key="s3cret") as client:
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model=tiny_model.name, messages=MESSAGES)  # type: ignore[arg-type]
        async with sdk(base, key="unused") as client:
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(
                    model=tiny_model.name,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    extra_headers={"Authorization": "", "x-api-key": "s3cret"},
                )
    assert await nothing_stored(redis, tiny_model.name)


async def test_model_without_a_live_worker_is_503(api: str, redis: aioredis.Redis) -> None:
    card = tiny_card(name="orphan")
    await publish_card(redis, card)  # a card, but no heartbeat
    async with sdk(api) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=card.name, messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.status_code == 503
    assert await nothing_stored(redis, card.name)
