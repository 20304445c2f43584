"""Bad input, auth, limits, health and model listing against a real server and Redis.

Every rejection must come back as the format's JSON error body (never FastAPI's 422) and leave
nothing behind: no arq job, no request hash, nothing in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anthropic
import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.config import Settings
from shared.model_card import ModelCard
from tests.integration.server_harness import announce_worker, publish_card, running_api, tiny_card

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]


async def assert_nothing_enqueued(redis: aioredis.Redis, model: str = "tiny-test") -> None:
    assert await redis.zcard(keys.queue(model)) == 0
    assert await redis.keys("arq:job:*") == []
    assert await redis.keys(f"{keys.PREFIX}:request:*") == []
    assert await redis.zcard(keys.inflight(model)) == 0


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, None),
        (b"[1, 2]", 400, None, None),
        (b'{"messages": []}', 400, "model", None),
        (b'{"model": "tiny-test", "max_tokens": "many"}', 400, "max_tokens", None),
        (b'{"model": "tiny-test", "messages": [{"role": "robot"}]}', 400, "messages[0].role", None),
        (b'{"model": "tiny-test", "temperature": 0.5}', 400, "temperature", None),
        (b'{"model": "tiny-test", "request_id": "mine"}', 400, "request_id", None),
        (b'{"model": "tiny-test", "max_tokens": 0}', 400, "max_tokens", None),
        (b'{"model": "nope", "messages": []}', 404, "model", "model_not_found"),
    ],
)
async def test_bad_input_is_a_json_error_and_enqueues_nothing(
    api: str,
    redis: aioredis.Redis,
    tiny_model: ModelCard,
    body: bytes,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    async with httpx.AsyncClient(base_url=api) as client:
        response = await client.post(
            "/v1/requests", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "retryable"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert error["code"] == code
    await assert_nothing_enqueued(redis)


async def test_context_overflow(api: str, redis: aioredis.Redis, tiny_model: ModelCard) -> None:
    long = [{"role": "user", "content": [{"type": "text", "text": "hello " * 80}]}]
    async with httpx.AsyncClient(base_url=api) as client:
        too_long = await client.post("/v1/requests", json={"model": "tiny-test", "messages": long})
        too_much = await client.post(
            "/v1/requests", json={"model": "tiny-test", "messages": MSG, "max_tokens": 64}
        )
    for response in (too_long, too_much):
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
    await assert_nothing_enqueued(redis)


async def test_no_live_worker_is_503(api: str, redis: aioredis.Redis) -> None:
    await publish_card(redis, tiny_card())  # a card, but no heartbeat
    async with httpx.AsyncClient(base_url=api) as client:
        response = await client.post("/v1/requests", json={"model": "tiny-test", "messages": MSG})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_worker"
    assert "retry-after" in response.headers
    await assert_nothing_enqueued(redis)


async def test_full_queue_is_429(
    redis_url: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    settings = Settings(redis_url=redis_url, queue_max=2)
    async with running_api(settings) as api, httpx.AsyncClient(base_url=api) as client:
        accepted = [
            await client.post("/v1/requests", json={"model": "tiny-test", "messages": MSG})
            for _ in range(2)
        ]
        rejected = await client.post("/v1/requests", json={"model": "tiny-test", "messages": MSG})
    assert [r.status_code for r in accepted] == [200, 200]
    assert rejected.status_code == 429
    assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
    assert rejected.headers["retry-after"] == "1"
    assert await redis.zcard(keys.queue("tiny-test")) == 2


async def test_body_too_large_is_413(
    redis_url: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    settings = Settings(redis_url=redis_url, max_body_bytes=1000)
    big = {
        "model": "tiny-test",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a " * 1000}]}],
    }
    async with running_api(settings) as api, httpx.AsyncClient(base_url=api) as client:
        response = await client.post("/v1/requests", json=big)
        anthropic_path = await client.post("/v1/messages", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert anthropic_path.status_code == 413
    assert anthropic_path.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "request body exceeds 1000 bytes"},
    }
    await assert_nothing_enqueued(redis)


async def test_unknown_routes_use_the_path_format(api: str) -> None:
    async with httpx.AsyncClient(base_url=api) as client:
        openai_404 = await client.get("/v1/nothing-here")
        anthropic_404 = await client.get("/v1/messages/nothing/here")
        wrong_method = await client.delete("/v1/requests")
    assert openai_404.status_code == 404
    assert openai_404.json()["error"]["type"] == "invalid_request_error"
    assert anthropic_404.status_code == 404
    assert anthropic_404.json()["error"]["type"] == "not_found_error"
    assert wrong_method.status_code == 405
    assert "error" in wrong_method.json()


@pytest.fixture
async def keyed_api(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[str]:
    settings = Settings(redis_url=redis_url, api_keys=["key-a", "key-b"])
    async with running_api(settings) as base:
        yield base


async def test_auth(keyed_api: str, redis: aioredis.Redis, tiny_model: ModelCard) -> None:
    body = {"model": "tiny-test", "messages": MSG}
    async with httpx.AsyncClient(base_url=keyed_api) as client:
        missing = await client.post("/v1/requests", json=body)
        wrong = await client.post("/v1/requests", json=body, headers={"authorization": "Bearer x"})
        anth = await client.get("/v1/messages/x", headers={"x-api-key": "nope"})
        health = await client.get("/healthz")
        bearer = await client.post(
            "/v1/requests", json=body, headers={"authorization": "Bearer key-a"}
        )
        rid = bearer.json()["id"]
        own = await client.post(f"/v1/requests/{rid}/cancel", headers={"x-api-key": "key-a"})
        other = await client.get(f"/v1/requests/{rid}/events", headers={"x-api-key": "key-b"})
    assert missing.status_code == wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert anth.status_code == 401 and anth.json()["error"]["type"] == "authentication_error"
    assert health.status_code == 200
    assert bearer.status_code == 200 and own.status_code == 200
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
    owner = await redis.hget(keys.request(rid), "owner")  # type: ignore[misc]
    assert owner is not None and b"key-a" not in owner and len(owner) == 64


async def test_readyz(api: str, redis: aioredis.Redis) -> None:
    async with httpx.AsyncClient(base_url=api) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        not_ready = await client.get("/readyz")
        await announce_worker(redis, "tiny-test")
        ready = await client.get("/readyz")
    assert not_ready.status_code == 503 and not_ready.json()["status"] == "no_worker"
    assert ready.status_code == 200 and ready.json()["models"] == {"tiny-test": 1}


async def test_models_parsed_by_both_sdks(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    await publish_card(redis, tiny_card("dormant"))  # published, but no live worker: not listed

    def list_both() -> tuple[list[openai.types.Model], list[anthropic.types.ModelInfo]]:
        oa = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0)
        an = anthropic.Anthropic(base_url=api, api_key="unused", max_retries=0)
        return list(oa.models.list()), list(an.models.list())

    import asyncio

    oa_models, an_models = await asyncio.to_thread(list_both)
    assert [(m.id, m.owned_by, m.created) for m in oa_models] == [
        ("tiny-test", "sluice", 1_700_000_000)
    ]
    assert [(m.id, m.display_name, m.created_at.timestamp()) for m in an_models] == [
        ("tiny-test", "tiny-test", 1_700_000_000)
    ]
    async with httpx.AsyncClient(base_url=api) as client:
        one = await client.get("/v1/models/tiny-test")
        dormant = await client.get("/v1/models/dormant")
    assert one.json()["id"] == "tiny-test"
    assert dormant.status_code == 404 and dormant.json()["error"]["code"] == "model_not_found"


async def test_the_queue_bound_holds_under_a_burst(
    settings: Settings, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    """40 submissions at once against a bound of 16: exactly 16 get in, the rest are 429."""
    bounded = Settings.from_env({}, **{**msgspec.structs.asdict(settings), "queue_max": 16})
    text = [{"type": "text", "text": "hello"}]
    body = {"model": tiny_model.name, "messages": [{"role": "user", "content": text}]}
    async with running_api(bounded) as base, httpx.AsyncClient(base_url=base, timeout=30) as c:
        replies = await asyncio.gather(*(c.post("/v1/requests", json=body) for _ in range(40)))
    statuses = sorted(r.status_code for r in replies)
    assert statuses == [200] * 16 + [429] * 24
    assert await redis.zcard(keys.queue(tiny_model.name)) == 16
    assert await redis.zcard(keys.inflight(tiny_model.name)) == 16  # the refused left no trace
    assert all(r.headers.get("retry-after") for r in replies if r.status_code == 429)
