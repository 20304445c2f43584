"""The state the app's lifespan owns, and how a request handler reaches it.

Kept apart from ``app.py`` so that routes, the streaming pipeline and admission can name
``AppState`` without importing the module that mounts the routes (no import circle).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from arq.connections import ArqRedis
from fastapi import Request

from services.api.cards import CardCache
from services.api.hub import StreamHub
from services.api.metrics import ApiMetrics
from shared.config import Settings

__all__ = ["AppState", "get_state"]


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


def get_state(request: Request) -> AppState:
    """The app state of the request's application.

    Args:
        request: any request.

    Returns:
        The ``AppState`` the lifespan created.
    """
    state: AppState = request.app.state.sluice
    return state
