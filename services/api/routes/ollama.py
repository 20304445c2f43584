"""Ollama's API: ``/api/chat``, ``/api/generate``, the model endpoints, and replay.

Thin like the other formats' routes: parse (``wire.ollama``), submit, then stream NDJSON
through the shared pipeline (the projector asks for NDJSON framing) or render the fold of the
same events. Errors leave through the app's handlers in Ollama's ``{"error": ...}`` envelope
(every path under ``/api/``). ``options.num_ctx`` below the model's context caps the completion
so that prompt and completion fit in it (rendering the prompt once more to count it); a larger
one is the model's own context. Because every answer is a durable event log, ``GET
/api/chat/{id}`` (or ``/api/generate/{id}``) re-projects any request the caller's key created,
in any format, as one Ollama body, and ``.../events`` re-streams it as NDJSON, resuming after
the first ``?lines=`` lines (NDJSON lines carry no ids) or after a ``Last-Event-ID``/``?after=``
entry id like the SSE formats.
"""

from __future__ import annotations

import time

import msgspec
from fastapi import Request, Response

from services.api.auth import authenticate
from services.api.formats import FormatRouter
from services.api.ownership import REQUESTS, RETRIEVABLE, Stored, load_owned
from services.api.replay import catch_up
from services.api.state import AppState, get_state
from services.api.stream_ids import parse_id
from services.api.streaming import collect_events, sse_response
from services.api.submit import new_request_id, render_prompt, submit
from services.api.wire import ollama
from services.api.wire.common import decode_body, error_location, service_error
from shared import keys
from shared.accumulate import fold
from shared.errors import ContextOverflow, InvalidRequest, ModelNotFound
from shared.jobs import GenerateRequest, Job
from shared.model_card import ModelCard

__all__ = ["router"]

router = FormatRouter("/api", "ollama", ollama.error_body)
_JSON = msgspec.json.Encoder()


def _context(job: GenerateRequest, mode: ollama.types.Mode) -> ollama.Context:
    return ollama.Context(
        mode=mode,
        model=job.model,
        created_ms=int(job.created * 1000),
        show_thinking=job.reasoning.visible,
        logprobs=job.sampling.logprobs,
    )


def _json(body: object, headers: dict[str, str] | None = None) -> Response:
    return Response(_JSON.encode(body), media_type="application/json", headers=headers)


async def _fit_context(state: AppState, parsed: ollama.Parsed) -> GenerateRequest:
    """The job with ``max_tokens`` capped so prompt and completion fit in ``num_ctx``."""
    job, window = parsed.job, parsed.num_ctx
    loaded = await state.cards.get(job.model)
    if window is None or window >= loaded.card.context_length:
        return job
    prompt = len((await render_prompt(loaded.renderer, job)).token_ids)
    if prompt >= window:
        raise ContextOverflow(
            f"the prompt is {prompt} tokens, which does not fit in num_ctx {window}",
            param="options.num_ctx",
            prompt_tokens=prompt,
            max_tokens=job.max_tokens or 1,
            context_length=window,
        )
    room = window - prompt
    return msgspec.structs.replace(job, max_tokens=min(job.max_tokens or room, room))


async def _generate(request: Request, mode: ollama.types.Mode) -> Response:
    state = get_state(request)
    owner = await authenticate(request)
    body = await request.body()
    rid = new_request_id("ollama")
    parse = ollama.parse_chat if mode == "chat" else ollama.parse_generate
    parsed = parse(body, request_id=rid)
    if parsed.load_only:
        return await _loaded(state, parsed.job, mode)
    job = await submit(state, await _fit_context(state, parsed), owner=owner)
    ctx = _context(job, mode)
    headers = {"x-request-id": job.request_id}
    if parsed.stream:
        return sse_response(state, request, job.request_id, ollama.Projector(ctx), headers=headers)
    return await _body(state, request, job.request_id, ctx, headers)


async def _loaded(state: AppState, job: GenerateRequest, mode: ollama.types.Mode) -> Response:
    """Ollama's answer to a request with nothing to generate: the model is (already) loaded."""
    await state.cards.get(job.model)  # an unknown model is still a 404
    body: dict[str, object] = {"model": job.model, "created_at": ollama.timestamp(_now_ms())}
    if mode == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return _json({**body, "done_reason": "load", "done": True})


def _now_ms() -> int:
    # Only the load answer reads the clock: nothing was generated, so there is no log to date it.
    return int(time.time() * 1000)


async def _timing(state: AppState, rid: str) -> ollama.Timing:
    """When the log's first and last entries were written: the generation's start and end."""
    key = keys.events(rid)
    first = await state.redis.xrange(key, count=1)
    last = await state.redis.xrevrange(key, count=1)
    if not first or not last:
        return ollama.Timing()
    start, _ = parse_id(first[0][0].decode())
    end, _ = parse_id(last[0][0].decode())
    return ollama.Timing(start_ms=start, end_ms=end)


async def _body(
    state: AppState, request: Request, rid: str, ctx: ollama.Context, headers: dict[str, str]
) -> Response:
    completion = fold(await collect_events(state, request, rid))
    if completion.error is not None:
        raise service_error(completion.error)
    body = ollama.render(completion, ctx, await _timing(state, rid))
    return _json(body, headers)


@router.post("/chat")
async def chat(request: Request) -> Response:
    """Chat, streamed as NDJSON unless ``stream`` is false."""
    return await _generate(request, "chat")


@router.post("/generate")
async def generate(request: Request) -> Response:
    """Complete a prompt (rendered with the chat template), streamed unless ``stream`` is false."""
    return await _generate(request, "generate")


async def _live_cards(state: AppState) -> list[ModelCard]:
    live = await state.cards.live_models(fresh=True)
    return await state.cards.cards(sorted(live))


@router.get("/tags")
async def tags(request: Request) -> Response:
    """The models a live worker serves."""
    return _json(ollama.tags_body(await _live_cards(get_state(request))))


@router.get("/ps")
async def ps(request: Request) -> Response:
    """The loaded models: every served model stays loaded."""
    return _json(ollama.ps_body(await _live_cards(get_state(request))))


@router.get("/version")
async def version() -> Response:
    """The Ollama API version sluice speaks."""
    return _json({"version": ollama.VERSION})


class _ShowBody(msgspec.Struct, forbid_unknown_fields=False):
    model: str | None = None
    name: str | None = None  # the older spelling, still sent by some clients


_SHOW = msgspec.json.Decoder(_ShowBody)


def _invalid(exc: msgspec.ValidationError) -> InvalidRequest:
    return InvalidRequest(str(exc), param=error_location(str(exc))[1])


@router.post("/show")
async def show(request: Request) -> Response:
    """One served model's details."""
    req = decode_body(_SHOW, await request.body(), _invalid)
    name = req.model or req.name
    if not name:
        raise InvalidRequest("model is required", param="model")
    for card in await _live_cards(get_state(request)):
        if card.name == name:
            return _json(ollama.show_body(card))
    raise ModelNotFound(f"model '{name}' not found", param="model")


async def _stored(request: Request, rid: str, stored: Stored[Job]) -> Job:
    return await load_owned(get_state(request), stored, rid, await authenticate(request))


async def _retrieve(request: Request, rid: str, mode: ollama.types.Mode) -> Response:
    state = get_state(request)
    ctx = _context(await _stored(request, rid, RETRIEVABLE), mode)
    return await _body(state, request, rid, ctx, {"x-request-id": rid})


async def _replay(request: Request, rid: str, mode: ollama.types.Mode) -> Response:
    state = get_state(request)
    projector = ollama.Projector(_context(await _stored(request, rid, REQUESTS), mode))
    raw = request.query_params.get("lines", "0")
    if not raw.isdigit():
        raise InvalidRequest("lines must be a non-negative integer", param="lines")
    after = await catch_up(state, request, rid, projector)
    stream = ollama.Skip(projector, int(raw)) if int(raw) else projector
    headers = {"x-request-id": rid}
    return sse_response(state, request, rid, stream, after=after, headers=headers)


@router.get("/chat/{rid}")
async def retrieve_chat(rid: str, request: Request) -> Response:
    """A stored request as one ``/api/chat`` body (waits for the end if still generating)."""
    return await _retrieve(request, rid, "chat")


@router.get("/generate/{rid}")
async def retrieve_generate(rid: str, request: Request) -> Response:
    """A stored request as one ``/api/generate`` body."""
    return await _retrieve(request, rid, "generate")


@router.get("/chat/{rid}/events")
async def replay_chat(rid: str, request: Request) -> Response:
    """A stored request re-streamed as ``/api/chat`` NDJSON, or resumed."""
    return await _replay(request, rid, "chat")


@router.get("/generate/{rid}/events")
async def replay_generate(rid: str, request: Request) -> Response:
    """A stored request re-streamed as ``/api/generate`` NDJSON, or resumed."""
    return await _replay(request, rid, "generate")
