"""``sluice api``: serve the app with uvicorn on ``settings.host:settings.port``."""

from __future__ import annotations

import gc
import importlib.util

import uvicorn

from services.api.app import create_app
from shared import logs
from shared.config import Settings

__all__ = ["GC_YOUNG_THRESHOLD", "run_api"]

GC_YOUNG_THRESHOLD = 10_000


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_api(settings: Settings) -> int:
    """Run the API server until interrupted.

    Args:
        settings: the process settings.

    Returns:
        The process exit code.
    """
    logs.configure(settings)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # uvicorn's loggers go through ours (one format), and the app writes its own access
        # line per request (services/api/access.py: route, format, tokens, durations).
        log_config=None,
        access_log=False,
        # Slow SSE clients are handled by the hub's back-pressure; don't let uvicorn cut
        # long-lived streams or buffer them.
        timeout_keep_alive=30,
        # The C event loop and HTTP parser roughly halve the per-event cost of a stream;
        # uvicorn[standard] installs both, a bare uvicorn falls back to asyncio + h11.
        loop="uvloop" if _has("uvloop") else "asyncio",
        http="httptools" if _has("httptools") else "h11",
    )
    server = uvicorn.Server(config)
    # Everything imported and built so far lives as long as the process: move it out of the
    # collector's sight. A full collection traverses the whole tracked heap (~67,000 objects
    # after startup, ~55 ms on the 2-vCPU dev VM) and stalls every stream at once, the whole
    # 50 ms p99 added-delay budget; per-event allocations trigger one now and then. Frozen, a
    # full pass sees only what the streams allocated since.
    # https://docs.python.org/3/library/gc.html#gc.freeze
    gc.collect()
    gc.freeze()
    # With the default young generation (a pass every 700 net allocations) the collector took a
    # fifth of the API's CPU at 500 streams x 20 events/s (py-spy --native: gc_collect_main,
    # mostly under the hub's reply parsing). What a stream allocates per event (reply lists,
    # entry dicts, frames) dies within the event: a larger young generation finds it dead
    # instead of promoting it, and runs a pass per 10,000 allocations, not per 700.
    gc.set_threshold(GC_YOUNG_THRESHOLD)
    server.run()
    return 0 if server.started else 1
