"""Liveness and readiness probes (no auth: orchestrators call them without keys).

``/healthz`` says the process is up. ``/readyz`` says it can serve: Redis answers and at least
one worker's heartbeat is live; otherwise 503 with what is missing. ``/metrics`` is this
process's Prometheus exposition (``services/api/metrics.py``), unauthenticated like the probes:
it carries counts and model names, never request content.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.api.metrics import CONTENT_TYPE
from services.api.state import get_state

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz")
async def healthz() -> JSONResponse:
    """The process is up and serving HTTP."""
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Redis is reachable and at least one worker heartbeat is live (503 otherwise)."""
    state = get_state(request)
    try:
        await state.redis.ping()
        live = await state.cards.live_models(fresh=True)
    except Exception as exc:  # boundary: a probe reports failure, it does not raise
        return JSONResponse(
            {"status": "unavailable", "redis": False, "error": str(exc), "models": {}},
            status_code=503,
        )
    ready = bool(live)
    return JSONResponse(
        {"status": "ready" if ready else "no_worker", "redis": True, "models": live},
        status_code=200 if ready else 503,
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition of this API process, plus the queue gauges read from Redis."""
    state = get_state(request)
    return Response(await state.metrics.render(state.redis), media_type=CONTENT_TYPE)
