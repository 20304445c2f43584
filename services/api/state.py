"""The state the app's lifespan owns, and how a request handler reaches it.

Kept apart from ``app.py`` so that routes, the streaming pipeline and admission can name
``AppState`` without importing the module that mounts the routes (no import circle).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from fastapi import Request

from services.api.cards import CardCache
from services.api.hub import StreamHub
from services.api.metrics import ApiMetrics
from services.api.wire.reasoning_tokens import ReasoningSigner, derive_key
from services.queue.client import Queue
from shared import keys
from shared.config import Settings

__all__ = ["AppState", "get_state", "load_owner_secret", "load_reasoning_key"]


@dataclass
class AppState:
    """Everything a request handler needs; stored on ``app.state.sluice``."""

    settings: Settings
    redis: aioredis.Redis
    queue: Queue  # the model queues (on the queue Redis when it is a separate one)
    hub: StreamHub
    cards: CardCache
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    background: set[asyncio.Task[None]] = field(default_factory=set)  # fire-and-forget work
    reasoning_key: bytes = b""  # signs thinking blocks and encrypted_content (lifespan sets it)
    owner_secret: str = ""  # HMAC key of owner ids (lifespan sets it; ``auth.owner_id``)

    @property
    def signer(self) -> ReasoningSigner:
        """The deployment's reasoning-token signer."""
        return ReasoningSigner(self.reasoning_key)


async def load_reasoning_key(redis: aioredis.Redis, settings: Settings) -> bytes:
    """The key of reasoning tokens: from the configured secret, else one shared through Redis.

    The first replica to start generates the secret (``SET NX``) and every other one reads the
    same value, so a token signed by one replica verifies on all of them. It never expires.

    Args:
        redis: the app's Redis client.
        settings: the settings (``reasoning_secret``).

    Returns:
        The signing key.
    """
    if settings.reasoning_secret:
        return derive_key(settings.reasoning_secret.encode())
    return derive_key((await _shared_secret(redis, keys.reasoning_secret())).encode())


async def load_owner_secret(redis: aioredis.Redis, settings: Settings) -> str:
    """The HMAC key of owner ids: the configured secret, else one shared through Redis.

    Generated like the reasoning secret (``load_reasoning_key``), so that without
    ``SLUICE_OWNER_SECRET`` the stored owner ids are keyed too, and the same on every replica.

    Args:
        redis: the app's Redis client.
        settings: the settings (``owner_secret``).

    Returns:
        The secret.
    """
    if settings.owner_secret:
        return settings.owner_secret
    return await _shared_secret(redis, keys.owner_secret())


async def _shared_secret(redis: aioredis.Redis, key: str) -> str:
    """The secret at ``key``: the first replica to start writes it (``SET NX``), every other
    one reads the same value. It never expires."""
    await redis.set(key, secrets.token_hex(32), nx=True)
    stored = await redis.get(key)
    return stored.decode() if isinstance(stored, bytes) else str(stored)


def get_state(request: Request) -> AppState:
    """The app state of the request's application.

    Args:
        request: any request.

    Returns:
        The ``AppState`` the lifespan created.
    """
    state: AppState = request.app.state.sluice
    return state
