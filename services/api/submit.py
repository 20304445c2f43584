"""Admission: validate a canonical job, render and tokenize it, store it, enqueue it.

Every wire route ends in ``submit``. The checks run in order of cost and nothing is written to
Redis until all of them pass, so a rejected request leaves no trace: unknown model (404), no
live worker (503), prompt too long for the context (400), queue full (429 with Retry-After).
Then one pipeline stores the request hash and the in-flight entry, and arq gets the job with
``job id = request id`` (a duplicate enqueue is a no-op) and a msgpack payload.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

import msgspec

from shared import keys
from shared.codec import decode_job, encode_job
from shared.errors import (
    ContextOverflow,
    InvalidRequest,
    NotFound,
    NoWorker,
    PermissionDenied,
    RateLimited,
)
from shared.jobs import GenerateRequest

if TYPE_CHECKING:
    from services.api.state import AppState

__all__ = ["ARQ_FUNCTION", "cancel", "load_job", "new_request_id", "submit"]

ARQ_FUNCTION = "generate"  # the job function services/worker/jobs.py registers


def new_request_id(prefix: str = "req") -> str:
    """A fresh, unguessable request id such as ``req_3f9a…`` (24 hex digits).

    Args:
        prefix: the id's prefix.

    Returns:
        The id.
    """
    return f"{prefix}_{secrets.token_hex(12)}"


async def submit(
    state: AppState, job: GenerateRequest, *, owner: str | None = None
) -> GenerateRequest:
    """Validate, render, tokenize, store and enqueue a job.

    Args:
        state: the app state.
        job: the canonical job; ``request_id`` may be empty (one is assigned).
        owner: the caller's owner id from ``authenticate``; None keeps ``job.owner``.

    Returns:
        The job as enqueued: ``request_id``, ``prompt_token_ids``, ``prompt_text``, ``owner``
        and ``created`` filled in.

    Raises:
        ModelNotFound: no card for ``job.model``.
        NoWorker: a card but no live worker for it.
        InvalidRequest: the chat template rejected the conversation.
        ContextOverflow: prompt + ``max_tokens`` (or 1) exceeds the context length.
        RateLimited: the model's queue holds ``queue_max`` jobs or more.
    """
    loaded = await state.cards.get(job.model)
    if not await state.cards.has_worker(job.model):
        raise NoWorker(f"no worker is serving '{job.model}' right now", retry_after=5)
    if job.max_tokens is not None and job.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    try:
        rendered = await asyncio.to_thread(loaded.renderer.render, job)
    except ValueError as exc:  # TemplateError and tokenizer failures: the input is at fault
        raise InvalidRequest(f"could not render the conversation: {exc}", param="messages") from exc
    prompt_ids = list(rendered.token_ids)
    context = loaded.card.context_length
    wanted = job.max_tokens or 1
    if len(prompt_ids) + wanted > context:
        raise ContextOverflow(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(prompt_ids) + wanted} tokens ({len(prompt_ids)} in the messages, {wanted} in "
            "the completion). Please reduce the length of the messages or completion.",
            param="messages",
        )
    queue = keys.queue(job.model)
    queued = await state.redis.zcard(queue)
    if queued >= state.settings.queue_max:
        raise RateLimited(f"the queue for '{job.model}' is full ({queued} requests)", retry_after=1)
    rid = job.request_id or new_request_id()
    job = msgspec.structs.replace(
        job,
        request_id=rid,
        prompt_token_ids=prompt_ids,
        prompt_text=rendered.text,
        owner=job.owner if owner is None else owner,
        created=time.time(),
    )
    await _store(state, job)
    payload = encode_job(job)
    await state.arq.enqueue_job(
        ARQ_FUNCTION,
        payload,
        _job_id=rid,
        _queue_name=queue,
        _expires=state.settings.job_expires_s,
    )
    return job


async def _store(state: AppState, job: GenerateRequest) -> None:
    retention = state.settings.retention_s
    async with state.redis.pipeline(transaction=True) as pipe:
        pipe.hset(
            keys.request(job.request_id),
            mapping={
                "owner": job.owner,
                "model": job.model,
                "created": repr(job.created),
                "origin": job.origin,
                "job": encode_job(job),
            },
        )
        pipe.expire(keys.request(job.request_id), retention)
        pipe.zadd(keys.inflight(job.model), {job.request_id: int(job.created * 1000)})
        await pipe.execute()


async def load_job(state: AppState, rid: str, owner: str) -> GenerateRequest:
    """Load a stored request for its owner.

    Args:
        state: the app state.
        rid: the request id.
        owner: the caller's owner id.

    Returns:
        The job as it was enqueued.

    Raises:
        NotFound: no such request (or its retention expired).
        PermissionDenied: another key created it.
    """
    fields = await state.redis.hmget(keys.request(rid), ["owner", "job"])  # type: ignore[misc]
    stored_owner, payload = fields[0], fields[1]
    if payload is None:
        raise NotFound(f"no request with id '{rid}'", param="id")
    if (stored_owner or b"").decode() != owner:
        raise PermissionDenied("this request was created with another API key")
    return decode_job(payload)


async def cancel(state: AppState, rid: str) -> None:
    """Raise the cancel flag the worker checks between decode steps.

    Args:
        state: the app state.
        rid: the request id.
    """
    await state.redis.set(keys.cancel(rid), b"1", ex=state.settings.retention_s)
