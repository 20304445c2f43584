"""Fixtures for integration tests: settings on the test Redis db, a live API, a scripted worker.

``api`` serves the real app with uvicorn on a free port (see ``server_harness``). ``worker`` runs
the real worker with the scripted backend (``tests/integration/worker_harness.py``);
``steady_worker`` is the same with a lease no busy CI box outlives. ``tiny_model``
publishes a small real model card (tokenizer + template) with a live heartbeat, for tests that
exercise the API side alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from shared.config import Settings
from shared.model_card import ModelCard
from tests.integration.server_harness import announce_worker, publish_card, running_api, tiny_card

if TYPE_CHECKING:
    from tests.integration.worker_harness import WorkerHandle


@pytest.fixture
def settings(redis_url: str) -> Settings:
    """Settings pointing at the test database, with short timers for tests."""
    return Settings(redis_url=redis_url, keepalive_s=0.5, heartbeat_s=0.2, lease_ttl_s=3.0)


@pytest.fixture
async def api(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[str]:
    """Base URL of a real uvicorn server running ``create_app(settings)`` (db flushed first)."""
    async with running_api(settings) as base_url:
        yield base_url


@pytest.fixture
async def tiny_model(redis: aioredis.Redis) -> ModelCard:
    """A published tiny card named ``tiny-test`` with one live worker heartbeat."""
    card = tiny_card()
    await publish_card(redis, card)
    await announce_worker(redis, card.name)
    return card


@pytest.fixture
async def worker(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[object]:
    """A real worker process-in-thread serving the scripted backend (text, no delay)."""
    from tests.integration.worker_harness import running_worker

    async with running_worker(redis_url, model_spec="scripted:text?rate=0") as handle:
        yield handle


@pytest.fixture
async def steady_worker(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[WorkerHandle]:
    """A scripted text worker with a lease long enough that a busy CI box never "loses" it."""
    from tests.integration.worker_harness import running_worker

    overrides = {"lease_ttl_s": 10.0, "heartbeat_s": 0.5}
    async with running_worker(redis_url, "scripted:text?rate=0", overrides) as handle:
        yield handle
