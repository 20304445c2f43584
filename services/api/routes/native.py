"""The native, format-agnostic API: submit a canonical job, stream its typed events, cancel it.

``POST /v1/requests`` takes ``GenerateRequest`` as JSON (without the fields the server assigns)
and returns the request id. ``GET /v1/requests/{id}/events`` streams the events themselves as
SSE: ``event: <tag>``, ``data: <event JSON>``, and ``id: <Redis entry id>`` on the last frame of
each entry (one entry holds a decode step's events); ``Last-Event-ID`` or ``?after=`` resumes
after an id. Only the key that created a request may read or cancel it.
"""

from __future__ import annotations

import msgspec
from fastapi import Request
from fastapi.responses import Response

from services.api.auth import authenticate
from services.api.choices import owned_choices
from services.api.formats import FormatRouter
from services.api.ownership import REQUESTS, load_owned
from services.api.state import get_state
from services.api.stream_ids import parse_id
from services.api.streaming import sse_response
from services.api.submit import cancel, new_request_id, submit
from services.api.wire import openai_errors
from services.api.wire.native import NativeProjector, parse_job
from shared.errors import InvalidRequest

__all__ = ["router"]

router = FormatRouter("/v1/requests", "native", openai_errors.error_body)
_JSON = msgspec.json.Encoder()


@router.post("")
async def create_request(request: Request) -> Response:
    """Submit a canonical job; returns ``{"id", "object", "model", "created"}``."""
    state = get_state(request)
    owner = await authenticate(request)
    job = parse_job(await request.body(), new_request_id())
    job = await submit(state, job, owner=owner)
    body = {"id": job.request_id, "object": "request", "model": job.model, "created": job.created}
    return Response(_JSON.encode(body), media_type="application/json")


def _resume_id(request: Request) -> str:
    after = request.query_params.get("after") or request.headers.get("last-event-id") or "0-0"
    try:
        parse_id(after)
    except ValueError as exc:
        raise InvalidRequest(f"'{after}' is not a stream entry id", param="after") from exc
    return after


@router.get("/{rid}/events")
async def stream_events(rid: str, request: Request) -> Response:
    """Stream the request's events as SSE from the start, or after ``Last-Event-ID``/``after``."""
    state = get_state(request)
    await load_owned(state, REQUESTS, rid, await authenticate(request))
    return sse_response(state, request, rid, NativeProjector(), after=_resume_id(request))


@router.post("/{rid}/cancel")
async def cancel_request(rid: str, request: Request) -> Response:
    """Ask the worker to stop; the stream then ends with ``Finish(cancelled)`` (every choice's,
    for a request with ``n`` > 1)."""
    state = get_state(request)
    owner = await authenticate(request)
    job = await load_owned(state, REQUESTS, rid, owner)
    await cancel(state, *(await owned_choices(state, job, owner) if job.choice == 0 else [rid]))
    return Response(_JSON.encode({"id": rid, "cancelled": True}), media_type="application/json")
