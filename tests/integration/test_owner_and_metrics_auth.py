"""Owner ids are keyed even without ``SLUICE_OWNER_SECRET``, and ``/metrics`` follows the keys.

Without a configured secret the first API generates one into Redis (as the reasoning secret is)
and every replica keys owner ids with it; a configured secret keeps keying them as before.
``GET /metrics`` is open without API keys, needs an API key once they are set, and needs
exactly ``SLUICE_METRICS_KEY`` when that is set.
"""

from __future__ import annotations

import hashlib

import httpx
import pytest
import redis.asyncio as aioredis

from services.api.auth import owner_id
from shared import keys
from shared.config import Settings
from shared.model_card import ModelCard
from tests.integration.server_harness import running_api

pytestmark = pytest.mark.integration

BODY = {
    "model": "tiny-test",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
}
KEY = {"authorization": "Bearer key-a"}


async def _create(base: str) -> str:
    async with httpx.AsyncClient(base_url=base) as client:
        reply = await client.post("/v1/requests", json=BODY, headers=KEY)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["id"])


async def test_owner_ids_are_keyed_by_a_generated_secret_shared_by_replicas(
    redis_url: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    settings = Settings(redis_url=redis_url, api_keys=["key-a", "key-b"])
    async with running_api(settings) as first, running_api(settings) as second:
        rid = await _create(first)
        async with httpx.AsyncClient(base_url=second) as client:
            other = await client.post(f"/v1/requests/{rid}/cancel", headers={"x-api-key": "key-b"})
            own = await client.post(f"/v1/requests/{rid}/cancel", headers={"x-api-key": "key-a"})
    secret = await redis.get(keys.owner_secret())
    assert secret is not None and len(secret) == 64
    stored = (await redis.hget(keys.request(rid), "owner")).decode()  # type: ignore[misc]
    assert stored != hashlib.sha256(b"key-a").hexdigest()  # no longer the unkeyed hash
    assert stored == owner_id("key-a", secret.decode())
    assert other.status_code == 404 and own.status_code == 200  # the other replica agrees


async def test_a_configured_owner_secret_keeps_keying_owner_ids(
    redis_url: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    settings = Settings(redis_url=redis_url, api_keys=["key-a"], owner_secret="configured")
    async with running_api(settings) as base:
        rid = await _create(base)
    stored = (await redis.hget(keys.request(rid), "owner")).decode()  # type: ignore[misc]
    assert stored == owner_id("key-a", "configured")
    assert await redis.get(keys.owner_secret()) is None


@pytest.mark.parametrize(
    ("keys_", "metrics_key", "open_", "with_api_key", "with_metrics_key"),
    [
        ([], None, 200, 200, 200),  # no keys anywhere: open, as before
        (["key-a"], None, 401, 200, 401),  # API keys: /metrics needs one like /v1 does
        (["key-a"], "scrape", 401, 401, 200),  # its own key: only that one
        ([], "scrape", 401, 401, 200),
    ],
)
async def test_metrics_needs_the_metrics_key_or_an_api_key(
    redis_url: str,
    redis: aioredis.Redis,
    keys_: list[str],
    metrics_key: str | None,
    open_: int,
    with_api_key: int,
    with_metrics_key: int,
) -> None:
    settings = Settings(redis_url=redis_url, api_keys=keys_, metrics_key=metrics_key)
    async with running_api(settings) as base, httpx.AsyncClient(base_url=base) as client:
        anonymous = await client.get("/metrics")
        api_key = await client.get("/metrics", headers=KEY)
        scraper = await client.get("/metrics", headers={"authorization": "Bearer scrape"})
        probe = await client.get("/healthz")
    assert (anonymous.status_code, api_key.status_code) == (open_, with_api_key)
    assert scraper.status_code == with_metrics_key
    if anonymous.status_code == 401:
        assert anonymous.json()["error"]["code"] == "invalid_api_key"
    for reply in (anonymous, api_key, scraper):
        if reply.status_code == 200:
            assert "sluice_" in reply.text
    assert probe.status_code == 200  # the probes stay open
