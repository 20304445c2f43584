"""The state the app's lifespan owns, and how a request handler reaches it.

Kept apart from ``app.py`` so that routes, the streaming pipeline and admission can name
``AppState`` without importing the module that mounts the routes (no import circle).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from arq.connections import ArqRedis
from fastapi import Request

from services.api.cards import CardCache
from services.api.hub import StreamHub
from services.api.metrics import ApiMetrics
from services.api.wire.reasoning_tokens import ReasoningSigner, derive_key
from shared import keys
from shared.config import Settings

__all__ = ["AppState", "get_state", "load_reasoning_key"]


@dataclass
class AppState:
    """Everything a request handler needs; stored on ``app.state.sluice``."""

    settings: Settings
    redis: aioredis.Redis
    arq: ArqRedis
    hub: StreamHub
    cards: CardCache
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    background: set[asyncio.Task[None]] = field(default_factory=set)  # fire-and-forget work
    reasoning_key: bytes = b""  # signs thinking blocks and encrypted_content (lifespan sets it)

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
    await redis.set(keys.reasoning_secret(), secrets.token_hex(32), nx=True)
    stored = await redis.get(keys.reasoning_secret())
    return derive_key(stored if isinstance(stored, bytes) else str(stored).encode())


def get_state(request: Request) -> AppState:
    """The app state of the request's application.

    Args:
        request: any request.

    Returns:
        The ``AppState`` the lifespan created.
    """
    state: AppState = request.app.state.sluice
    return state
