"""The native, format-agnostic API: submit a canonical job, stream its typed events, cancel it.

``POST /v1/requests`` takes ``GenerateRequest`` as JSON (without the fields the server assigns)
and returns the request id. ``GET /v1/requests/{id}/events`` streams the events themselves as
SSE: ``event: <tag>``, ``data: <event JSON>``, and ``id: <Redis entry id>`` on the last frame of
each entry (one entry holds a decode step's events); ``Last-Event-ID`` or ``?after=`` resumes
after an id. Only the key that created a request may read or cancel it.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.api.auth import authenticate
from services.api.choices import owned_choices
from services.api.ownership import REQUESTS, load_owned
from services.api.state import get_state
from services.api.stream_ids import parse_id
from services.api.streaming import sse_response
from services.api.submit import cancel, new_request_id, submit
from services.api.wire import sse
from services.api.wire.common import UNDECODABLE, check_range, undecodable
from services.api.wire.constraints import check_tool_schemas
from shared.errors import InvalidRequest
from shared.events import AnyEvent
from shared.grammar import check_constraint
from shared.jobs import GenerateRequest, SamplingParams

__all__ = ["NativeProjector", "router"]

router = APIRouter()

_SERVER_FIELDS = ("request_id", "owner", "created", "prompt_token_ids", "prompt_text", "choice")
_JOB_FIELDS = frozenset(f.name for f in msgspec.structs.fields(GenerateRequest))
_JSON = msgspec.json.Encoder()
# What the job's msgpack holds (``wire.common.WireInt``): a larger number is a 400, not a 500.
# A seed may use all 64 bits unsigned, as the worker's sampler reads it.
_MIN_INT, _MAX_INT, _MAX_SEED = -(2**63), 2**63 - 1, 2**64 - 1


class NativeProjector:
    """Each event as one named SSE frame carrying the event's own JSON."""

    def feed(self, event: AnyEvent) -> list[sse.Frame]:
        """One frame per event: ``event:`` is the tag, ``data:`` the JSON event."""
        return [sse.Frame(data=_JSON.encode(event), event=str(event.__struct_config__.tag))]

    def close(self) -> list[sse.Frame]:
        """No sentinel: the terminal event (``finish``/``error``) ends the stream."""
        return []


def _parse_job(body: bytes, rid: str) -> GenerateRequest:
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    except UNDECODABLE as exc:
        raise undecodable(exc) from exc
    if not isinstance(raw, dict):
        raise InvalidRequest("the body must be a JSON object")
    for name in raw:
        if name in _SERVER_FIELDS:
            raise InvalidRequest(f"'{name}' is set by the server", param=name)
        if name == "n" and raw[name] != 1:
            # one request, one event stream here: several choices are several requests
            raise InvalidRequest("n must be 1 on the native API: submit n requests", param="n")
        if name not in _JOB_FIELDS:
            raise InvalidRequest(f"unknown field '{name}'", param=name)
    if "model" not in raw:
        raise InvalidRequest("'model' is required", param="model")
    raw["request_id"] = rid
    raw["origin"] = "native"
    try:
        job = msgspec.convert(raw, GenerateRequest)
    except msgspec.ValidationError as exc:
        message = str(exc)
        _, _, path = message.partition(" - at `$.")
        raise InvalidRequest(message, param=path.rstrip("`") or None) from exc
    _check_sampling(job.sampling)
    if job.min_tokens < 0:
        raise InvalidRequest("min_tokens must not be negative", param="min_tokens")
    check_range(job.min_tokens, 0, _MAX_INT, "min_tokens")
    check_range(job.max_tokens, 1, _MAX_INT, "max_tokens")
    check_range(job.reasoning.budget_tokens, _MIN_INT, _MAX_INT, "reasoning.budget_tokens")
    if job.constraint is not None:
        check_constraint(job.constraint, "constraint")
    check_tool_schemas(job.tools, job.tool_choice, lambda i: f"tools[{i}].parameters")
    return job


def _check_sampling(s: SamplingParams) -> None:
    """The wire formats' ranges: the worker decodes many requests in one batch, and a value it
    cannot sample with must be refused here rather than fail inside the decode step."""
    check_range(s.temperature, 0.0, 2.0, "sampling.temperature")
    check_range(s.top_p, 0.0, 1.0, "sampling.top_p")
    check_range(s.min_p, 0.0, 1.0, "sampling.min_p")
    check_range(s.presence_penalty, -2.0, 2.0, "sampling.presence_penalty")
    check_range(s.frequency_penalty, -2.0, 2.0, "sampling.frequency_penalty")
    check_range(s.top_logprobs, 0, 20, "sampling.top_logprobs")
    check_range(s.repetition_penalty, 1e-6, 100.0, "sampling.repetition_penalty")
    if s.top_k is not None and s.top_k < 0:
        raise InvalidRequest("sampling.top_k must not be negative", param="sampling.top_k")
    check_range(s.top_k, 0, _MAX_INT, "sampling.top_k")
    check_range(s.seed, _MIN_INT, _MAX_SEED, "sampling.seed")
    if s.top_logprobs and not s.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="sampling.top_logprobs")


@router.post("/v1/requests")
async def create_request(request: Request) -> Response:
    """Submit a canonical job; returns ``{"id", "object", "model", "created"}``."""
    state = get_state(request)
    owner = await authenticate(request)
    job = _parse_job(await request.body(), new_request_id())
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


@router.get("/v1/requests/{rid}/events")
async def stream_events(rid: str, request: Request) -> Response:
    """Stream the request's events as SSE from the start, or after ``Last-Event-ID``/``after``."""
    state = get_state(request)
    await load_owned(state, REQUESTS, rid, await authenticate(request))
    return sse_response(state, request, rid, NativeProjector(), after=_resume_id(request))


@router.post("/v1/requests/{rid}/cancel")
async def cancel_request(rid: str, request: Request) -> Response:
    """Ask the worker to stop; the stream then ends with ``Finish(cancelled)`` (every choice's,
    for a request with ``n`` > 1)."""
    state = get_state(request)
    owner = await authenticate(request)
    job = await load_owned(state, REQUESTS, rid, owner)
    await cancel(state, *(await owned_choices(state, job, owner) if job.choice == 0 else [rid]))
    return Response(_JSON.encode({"id": rid, "cancelled": True}), media_type="application/json")
