"""Liveness and readiness probes (no auth: orchestrators call them without keys).

``/healthz`` says the process is up. ``/readyz`` says it can serve: Redis answers and at least
one worker's heartbeat is live; otherwise 503 with what is missing. A heartbeat counts only if it
was written since the Redis server started: after a restart from an AOF the restored heartbeats
of workers that died with it would otherwise read as live for a lease TTL. ``/metrics`` is this
process's Prometheus exposition (``services/api/metrics.py``): counts and model names, never
request content, yet per-route traffic is no anonymous caller's business where the API is locked,
so it needs ``SLUICE_METRICS_KEY`` when set, else an API key when keys are set
(``auth.authorize_metrics``). ``/readyz``'s ``redis_memory`` shows
Redis's ``used_memory`` against its ``maxmemory``: a Redis filling up is seen before it refuses
writes (it does not make the probe fail: admission answers a full Redis with a 503 itself).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from services.api.auth import authorize_metrics
from services.api.metrics import CONTENT_TYPE
from services.api.state import get_state
from services.redis_oom import read_memory

__all__ = ["router"]

router = APIRouter()


@router.head("/")
async def probe() -> Response:
    """Claude Code probes ``HEAD /`` before its first request; any 200 will do."""
    return Response()


@router.get("/healthz")
async def healthz() -> JSONResponse:
    """The process is up and serving HTTP."""
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Redis is reachable and at least one worker heartbeat is live (503 otherwise)."""
    state = get_state(request)
    try:
        # A worker counts once it has beaten and polled its queue since both Redis servers (one
        # unless SLUICE_QUEUE_URL is set) started: its heartbeat resumes before its queue poll.
        started_ms = max([await _started_ms(state.redis), await _started_ms(state.queue.redis)])
        live = await state.cards.live_models(fresh=True, not_before_ms=started_ms)
        memory = await read_memory(state.redis)
    except Exception as exc:  # boundary: a probe reports failure, it does not raise
        return JSONResponse(
            {"status": "unavailable", "redis": False, "error": str(exc), "models": {}},
            status_code=503,
        )
    ready = bool(live)
    return JSONResponse(
        {
            "status": "ready" if ready else "no_worker",
            "redis": True,
            "models": live,
            "redis_memory": memory.as_json(),
        },
        status_code=200 if ready else 503,
    )


async def _started_ms(redis: Any) -> float:
    """The latest epoch ms at which ``redis`` can have started.

    Redis reports whole seconds (its start time floored, its clock cached), so the start is
    somewhere in [now - uptime - 1, now - uptime + 1): the latest it can be is what counts.
    """
    info = await redis.info("server")
    return (time.time() - int(info["uptime_in_seconds"]) + 1) * 1000


@router.get("/metrics", dependencies=[Depends(authorize_metrics)])
async def metrics(request: Request) -> Response:
    """Prometheus exposition of this API process, plus the queue gauges read from Redis."""
    state = get_state(request)
    return Response(await state.metrics.render(state.redis, state.queue), media_type=CONTENT_TYPE)
