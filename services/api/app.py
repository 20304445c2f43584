"""The FastAPI application factory: its lifespan builds the state, and every router is mounted.

``create_app(settings)`` builds an app with no module globals: the lifespan opens one Redis
connection pool (shared by the command client and the queue's client; a cluster events URL
gets a cluster client, ``services.redis_conn``), the ``StreamHub`` with its own blocking
connection (``ClusterStreamHub`` on a cluster), and the ``CardCache``, and closes them on
shutdown. Every router is mounted here; everything under ``/v1`` requires an API key when keys
are configured. Request bodies are capped at ``max_body_bytes`` by a pure ASGI wrapper (never
``BaseHTTPMiddleware``, which breaks streaming and disconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI
from redis.asyncio import ConnectionPool, Redis
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services import redis_conn
from services.api.access import Observe
from services.api.auth import authenticate
from services.api.cards import CardCache
from services.api.cluster_hub import ClusterStreamHub
from services.api.error_handlers import install_error_handlers
from services.api.hub import StreamHub
from services.api.metrics import ApiMetrics
from services.api.routes import (
    chat,
    completions,
    health,
    messages,
    models,
    native,
    ollama,
    responses,
    tokenize,
)
from services.api.sse_asgi import SERVER_SEND
from services.api.start_timeout import sweep_loop
from services.api.state import AppState, load_owner_secret, load_reasoning_key
from services.queue.client import Queue
from services.redis_conn import queue_client_url
from shared.config import Settings
from shared.errors import RequestTooLarge

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


class _BodyLimit:
    """Pure ASGI wrapper: a body over ``limit`` bytes raises ``RequestTooLarge`` when read.

    Raising from ``receive`` lands in the route that reads the body, so the error handlers render
    the 413 in the right wire format.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.limit
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            if too_large:
                raise RequestTooLarge(f"request body exceeds {self.limit} bytes")
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise RequestTooLarge(f"request body exceeds {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


class _App(FastAPI):
    """The app, handing the server's own ``send`` down in the scope (``sse_asgi.SERVER_SEND``).

    An SSE stream sends its body chunks straight to it, past the ``send`` wrappers of the
    middleware stack, which still see each response's start and end (``sse_asgi``).
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        scope[SERVER_SEND] = send
        status, answered = 0, False

        async def watched(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                answered = True
            await send(message)

        try:
            await super().__call__(scope, receive, watched)
        except Exception as exc:
            # Starlette re-raises an unhandled error after its handler has sent the 500, and
            # uvicorn closes the connection on any error that escapes a started response: the
            # client's next request on that keep-alive connection would read a reset. Once a
            # whole answer is out, the connection stays up; a mid-stream failure still closes it.
            if not answered:
                raise
            if status != 500:  # a 500 was the error handler's, which logged it already
                logger.error("error after the response on %s", scope["path"], exc_info=exc)


def create_app(settings: Settings) -> FastAPI:
    """Build the API application.

    Args:
        settings: the process settings.

    Returns:
        The app; its lifespan connects to Redis on startup.
    """
    metrics = ApiMetrics()  # before the lifespan: the wrapper counts from the first request

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        events_url, queue_url = settings.events_redis_url, settings.queue_redis_url
        queue_client_url(queue_url)  # a cluster URL there is a clear error, not a late one
        redis = redis_conn.client(events_url)
        # One single Redis (the default) shares one pool; a separate queue Redis gets its own.
        shared = queue_url == events_url
        queue_pool = redis.connection_pool if shared else ConnectionPool.from_url(queue_url)
        queue = Queue(redis if shared else Redis(connection_pool=queue_pool))
        hub: StreamHub = (
            ClusterStreamHub(events_url, redis)
            if redis_conn.is_cluster(redis)
            else StreamHub(events_url, redis)
        )
        hub.on_read = metrics.xread_entries.observe
        metrics.hub_subscriptions.set_function(lambda: hub.subscriptions)
        await hub.start()
        cards = CardCache(
            redis,
            lease_ttl_s=settings.lease_ttl_s,
            reasoning_when_hidden=settings.reasoning_when_hidden,
        )
        state = AppState(
            settings=settings, redis=redis, queue=queue, hub=hub, cards=cards, metrics=metrics
        )
        state.reasoning_key = await load_reasoning_key(redis, settings)
        state.owner_secret = await load_owner_secret(redis, settings)
        app.state.sluice = state
        # Requests nobody streams must time out too (the pipeline covers the watched ones).
        sweeper = asyncio.create_task(
            sweep_loop(redis, queue, settings), name="sluice-start-timeout"
        )
        try:
            yield
        finally:
            sweeper.cancel()
            await asyncio.gather(sweeper, return_exceptions=True)
            await hub.stop()
            if state.background:  # pending cancel flags: give them a moment to land
                await asyncio.wait(list(state.background), timeout=2)
            await redis.aclose()
            if not shared:
                await queue_pool.aclose()

    app = _App(
        title="sluice",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)
    _mount(app)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(Observe, metrics=metrics)  # outermost: sees every request's status
    return app


def _mount(app: FastAPI) -> None:
    guarded = [Depends(authenticate)]
    app.include_router(health.router)
    for module in (native, models, chat, completions, responses, messages, tokenize, ollama):
        app.include_router(module.router, dependencies=guarded)
