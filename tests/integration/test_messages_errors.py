"""HTTP errors of ``/v1/messages`` as the anthropic SDK sees them (no worker needed).

A published tiny card with a fake heartbeat lets the API admit requests; each test provokes one
rejection and checks the status, Anthropic's ``{"type": "error", "error": {...}}`` body and that
nothing was stored or enqueued.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any, cast

import anthropic
import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.config import Settings
from shared.model_card import ModelCard
from tests.integration.server_harness import publish_card, running_api, tiny_card

pytestmark = pytest.mark.integration

MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]


async def nothing_stored(redis: aioredis.Redis, model: str = "tiny-test") -> bool:
    stored = [k async for k in redis.scan_iter(match=keys.request("*"))]
    return not stored and await redis.zcard(keys.queue(model)) == 0


def sdk(base_url: str, key: str = "k") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=key, max_retries=0)


def envelope(err: anthropic.APIStatusError, kind: str) -> str:
    """Check Anthropic's error body shape and type; return the message."""
    body = err.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == kind
    message = body["error"]["message"]
    assert isinstance(message, str) and message
    return message


@pytest.fixture
async def http(api: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api) as client:
        yield client


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"model": "tiny-test", "messages": MESSAGES}, "max_tokens"),
        (
            {
                "model": "tiny-test",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "supported content block types",
        ),
        ({"model": "tiny-test", "max_tokens": 5, "messages": "hello"}, "messages"),
        ({"model": "tiny-test", "max_tokens": 5, "messages": MESSAGES, "top_k": "x"}, "top_k"),
        (
            {
                "model": "tiny-test",
                "max_tokens": 5,
                "messages": MESSAGES,
                "tool_choice": {"type": "any"},
            },
            "requires tools",
        ),
        (
            {
                "model": "tiny-test",
                "max_tokens": 5,
                "messages": MESSAGES,
                "output_config": {"format": {"type": "json_schema", "schema": {"not": {}}}},
            },
            "output_config.format.schema",
        ),
    ],
)
async def test_bad_input_is_an_anthropic_400_and_nothing_is_enqueued(
    http: httpx.AsyncClient, tiny_model: ModelCard, redis: aioredis.Redis, body: Any, fragment: str
) -> None:
    response = await http.post("/v1/messages", json=body)
    assert response.status_code == 400
    data = response.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert fragment in data["error"]["message"]
    assert await nothing_stored(redis)


async def test_invalid_json_and_sdk_bad_request(
    api: str, http: httpx.AsyncClient, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    response = await http.post(
        "/v1/messages", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    async with sdk(api) as client:
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(
                model="tiny-test",
                max_tokens=5,
                messages=cast(Any, [{"role": "user", "content": [{"type": "document"}]}]),
            )
    envelope(info.value, "invalid_request_error")
    assert await nothing_stored(redis)


async def test_context_window_overflow_is_invalid_request(
    api: str, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    async with sdk(api) as client:
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(
                model="tiny-test",
                max_tokens=5,
                messages=[{"role": "user", "content": "hello " * 100}],
            )
    message = envelope(info.value, "invalid_request_error")
    # Anthropic's exact sentence: Claude Code compacts the conversation when it reads it.
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
    assert match is not None, message
    assert int(match[1]) > int(match[2]) == tiny_model.context_length
    assert await nothing_stored(redis)


async def test_max_tokens_past_the_context_uses_anthropics_wording(
    api: str, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    # Claude Code's first request asks for max_tokens 32000 whatever the model; it reads the
    # three numbers out of this sentence and retries with a max_tokens that fits.
    async with sdk(api) as client:
        counted = await client.messages.count_tokens(model="tiny-test", messages=MESSAGES)
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(
                model="tiny-test", max_tokens=32000, messages=MESSAGES, stream=True
            )
        assert info.value.status_code == 400
        message = envelope(info.value, "invalid_request_error")
        assert message == (
            f"input length and `max_tokens` exceed context limit: {counted.input_tokens} + 32000 "
            f"> {tiny_model.context_length}, decrease input length or `max_tokens` and try again"
        )
        assert await nothing_stored(redis)
        room = tiny_model.context_length - counted.input_tokens
    # The retry with the max_tokens the sentence implies is admitted (no worker serves the
    # card, so the stream's headers are all there is to see).
    body = {"model": "tiny-test", "max_tokens": room, "messages": MESSAGES, "stream": True}
    async with (
        httpx.AsyncClient(base_url=api) as http_client,
        http_client.stream("POST", "/v1/messages", json=body) as response,
    ):
        assert response.status_code == 200


async def test_unknown_model_is_404_not_found(
    api: str, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    async with sdk(api) as client:
        with pytest.raises(anthropic.NotFoundError) as info:
            await client.messages.create(model="no-such-model", max_tokens=5, messages=MESSAGES)
        envelope(info.value, "not_found_error")
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="no-such-model", messages=MESSAGES)
    assert await nothing_stored(redis)


async def test_auth_x_api_key_and_bearer_then_full_queue_is_429(
    settings: Settings, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    keyed = msgspec.structs.replace(settings, api_keys=["s3cret"], queue_max=0)
    async with running_api(keyed) as base:
        async with sdk(base, key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await client.messages.create(model="tiny-test", max_tokens=5, messages=MESSAGES)
        envelope(info.value, "authentication_error")
        async with httpx.AsyncClient(base_url=base) as http:
            body = {"model": "tiny-test", "max_tokens": 5, "messages": MESSAGES}
            missing = await http.post("/v1/messages", json=body)
            assert missing.status_code == 401
            assert missing.json()["error"]["type"] == "authentication_error"
            for headers in ({"x-api-key": "s3cret"}, {"authorization": "Bearer s3cret"}):
                # Past auth, the deliberately full queue answers 429 with Retry-After.
                full = await http.post("/v1/messages?beta=true", json=body, headers=headers)
                assert full.status_code == 429, full.text
                assert full.json()["error"]["type"] == "rate_limit_error"
                assert full.headers["retry-after"].isdigit()
                counted = await http.post(
                    "/v1/messages/count_tokens",
                    json={"model": "tiny-test", "messages": MESSAGES},
                    headers=headers,
                )
                assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
        async with sdk(base, key="s3cret") as client:
            with pytest.raises(anthropic.RateLimitError) as limited:
                await client.messages.create(model="tiny-test", max_tokens=5, messages=MESSAGES)
        envelope(limited.value, "rate_limit_error")
    assert await nothing_stored(redis)


async def test_body_over_the_limit_is_413_request_too_large(
    settings: Settings, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    small = msgspec.structs.replace(settings, max_body_bytes=2_000)
    async with running_api(small) as base, sdk(base) as client:
        with pytest.raises(anthropic.APIStatusError) as info:
            await client.messages.create(
                model="tiny-test",
                max_tokens=5,
                messages=[{"role": "user", "content": "a " * 2_000}],
            )
    assert info.value.status_code == 413
    envelope(info.value, "request_too_large")
    assert await nothing_stored(redis)


async def test_model_without_a_live_worker_is_overloaded(api: str, redis: aioredis.Redis) -> None:
    await publish_card(redis, tiny_card(name="orphan"))
    async with sdk(api) as client:
        with pytest.raises(anthropic.APIStatusError) as info:
            await client.messages.create(model="orphan", max_tokens=5, messages=MESSAGES)
    assert info.value.status_code in (503, 529)
    envelope(info.value, "overloaded_error")
    assert info.value.response.headers["retry-after"].isdigit()
    assert await nothing_stored(redis, "orphan")


async def test_models_list_parses_in_the_anthropic_sdk_and_head_probe(
    api: str, http: httpx.AsyncClient, tiny_model: ModelCard
) -> None:
    async with sdk(api) as client:
        listed = [m async for m in client.models.list()]
    assert [m.id for m in listed] == ["tiny-test"]
    assert listed[0].display_name and listed[0].created_at.year >= 2023
    assert (await http.head("/")).status_code == 200


async def test_server_tools_are_accepted_and_named_in_a_header(
    api: str, tiny_model: ModelCard
) -> None:
    tools = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"name": "f", "input_schema": {"type": "object"}},
    ]
    body = {"model": "tiny-test", "max_tokens": 5, "messages": MESSAGES, "stream": True}
    async with (
        httpx.AsyncClient(base_url=api) as http_client,
        http_client.stream("POST", "/v1/messages", json={**body, "tools": tools}) as response,
    ):
        assert response.status_code == 200
        assert response.headers["x-sluice-ignored-tools"] == "web_search"
    forced = {**body, "tools": tools, "tool_choice": {"type": "tool", "name": "web_search"}}
    async with httpx.AsyncClient(base_url=api) as http_client:
        rejected = await http_client.post("/v1/messages", json=forced)
    assert rejected.status_code == 400
    assert rejected.json()["error"]["type"] == "invalid_request_error"
