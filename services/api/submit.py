"""Admission: validate a canonical request, render and tokenize it into a job, store, enqueue.

Every wire route ends in ``submit``. The checks run in order of cost and nothing is written to
Redis until all of them pass, so a rejected request leaves no trace: unknown model (404), no
live worker (503), prompt too long for the context (400), queue full (429 with Retry-After);
a Redis that refuses the writes for want of memory is a 503 with Retry-After too.
Then one pipeline stores the request hash and the in-flight entry, and the job goes onto the
model's queue (``services.queue``) with ``job id = request id`` (a duplicate enqueue is a no-op)
and a msgpack payload: the bound is checked in the same atomic step as the enqueue (a refused
request's hash and in-flight entry are removed again).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

import msgspec
from redis.exceptions import ResponseError

from services.api import access
from services.queue.client import QUEUE_FULL
from services.redis_conn import transactional
from services.redis_oom import OOM_MESSAGE, is_oom
from shared import keys, logs
from shared.codec import encode_job
from shared.errors import (
    ContextOverflow,
    InvalidRequest,
    NoWorker,
    RateLimited,
    ServiceError,
    Unavailable,
)
from shared.jobs import GenerateRequest, Job
from shared.prompt import NestingError, PromptRenderer, RenderedPrompt

if TYPE_CHECKING:
    from services.api.state import AppState

__all__ = ["cancel", "new_request_id", "render_prompt", "submit"]


def new_request_id(prefix: str = "req") -> str:
    """A fresh, unguessable request id such as ``req_3f9a…`` (24 hex digits).

    Args:
        prefix: the id's prefix.

    Returns:
        The id.
    """
    return f"{prefix}_{secrets.token_hex(12)}"


async def submit(
    state: AppState,
    job: GenerateRequest,
    *,
    owner: str | None = None,
    prompt: RenderedPrompt | None = None,
) -> Job:
    """Validate, render and tokenize a request, then store and enqueue it as a ``Job``.

    Args:
        state: the app state.
        job: the canonical request; ``request_id`` may be empty (one is assigned).
        owner: the caller's owner id from ``authenticate``; None keeps ``job.owner``.
        prompt: the prompt already tokenized (legacy completions: raw text, no template);
            None renders ``job.messages`` through the chat template.

    Returns:
        The job as enqueued: the request with ``request_id``, ``prompt_token_ids``,
        ``prompt_text``, ``owner`` and ``created`` filled in.

    Raises:
        ModelNotFound: no card for ``job.model``.
        NoWorker: a card but no live worker for it.
        InvalidRequest: the chat template rejected the conversation.
        ContextOverflow: prompt + ``max_tokens`` (or 1) exceeds the context length.
        RateLimited: the model's queue holds ``queue_max`` jobs or more.
        Unavailable: Redis refused to store the request (``maxmemory`` reached).
    """
    try:
        return await _admit(state, job, owner, prompt)
    except OverflowError as exc:
        # The job is msgpack, which holds 64-bit integers: a larger one in free-form JSON (a tool
        # schema, chat_template_kwargs) fails the encoder, before anything is written.
        err = InvalidRequest("a number in the request does not fit in 64 bits")
        state.metrics.rejections.labels(err.code, str(err.http_status)).inc()
        raise err from exc
    except ServiceError as exc:  # counted by reason: 429 and 503 are the ones to alert on
        state.metrics.rejections.labels(exc.code, str(exc.http_status)).inc()
        raise


async def _admit(
    state: AppState, job: GenerateRequest, owner: str | None, prompt: RenderedPrompt | None
) -> Job:
    loaded = await state.cards.get(job.model)
    if not await state.cards.has_worker(job.model):
        raise NoWorker(f"no worker is serving '{job.model}' right now", retry_after=5)
    if job.max_tokens is not None and job.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    rendered = prompt or await render_prompt(loaded.renderer, job)
    prompt_ids = list(rendered.token_ids)
    context = loaded.card.context_length
    wanted = job.max_tokens or 1
    if len(prompt_ids) + wanted > context:
        raise ContextOverflow(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(prompt_ids) + wanted} tokens ({len(prompt_ids)} in the messages, {wanted} in "
            "the completion). Please reduce the length of the messages or completion.",
            param="messages" if prompt is None else "prompt",
            prompt_tokens=len(prompt_ids),
            max_tokens=wanted,
            context_length=context,
        )
    queued = await state.queue.size(job.model)
    if queued >= state.settings.queue_max:
        raise RateLimited(f"the queue for '{job.model}' is full ({queued} requests)", retry_after=1)
    rid = job.request_id or new_request_id()
    request = msgspec.structs.replace(
        job, request_id=rid, owner=job.owner if owner is None else owner, created=time.time()
    )
    tokenized = Job.of(request, prompt_token_ids=prompt_ids, prompt_text=rendered.text)
    if (rec := access.record()) is not None:
        rec.request_id, rec.model = rid, job.model
    logs.bind(request_id=rid, model=job.model)
    sent = time.perf_counter()
    try:
        await _store(state, tokenized)
        enqueued = await _enqueue(state, tokenized)
    except ResponseError as exc:
        if not is_oom(exc):
            raise
        # Redis is full (maxmemory, noeviction): nothing was queued, so the client may retry
        # once memory is freed. The hash may be stored already; deleting is allowed when full,
        # and must happen: a sweeper would otherwise take the in-flight entry for a lost run.
        await _unstore(state, tokenized)
        raise Unavailable(OOM_MESSAGE, retry_after=1) from exc
    if enqueued == QUEUE_FULL:
        await _unstore(state, tokenized)
        raise RateLimited(f"the queue for '{job.model}' is full", retry_after=1)
    state.metrics.redis_rtt.labels("admit").observe(time.perf_counter() - sent)
    return tokenized


async def render_prompt(renderer: PromptRenderer, job: GenerateRequest) -> RenderedPrompt:
    """Render and tokenize off the event loop, with the input's failures as the client's 400.

    Admission and Anthropic's ``count_tokens`` both render through here, so a body one of them
    refuses is refused by the other with the same error.

    Args:
        renderer: the model's renderer.
        job: the canonical request.

    Returns:
        The rendered prompt.

    Raises:
        InvalidRequest: the template rejected the conversation, or a tool schema is nested too
            deeply to walk.
    """
    try:
        return await asyncio.to_thread(renderer.render, job)
    except NestingError as exc:
        raise InvalidRequest(str(exc), param="tools") from exc
    except ValueError as exc:  # TemplateError and tokenizer failures: the input is at fault
        raise InvalidRequest(f"could not render the conversation: {exc}", param="messages") from exc


async def _enqueue(state: AppState, job: Job) -> int:
    """The queue's enqueue (job id = request id, a duplicate is a no-op) with the queue bound
    checked atomically: the ``size`` above is only a cheap early refusal, and a burst would pass
    it all at once."""
    return await state.queue.enqueue(
        job.model,
        job.request_id,
        encode_job(job),
        enqueue_ms=int(time.time() * 1000),
        expires_ms=state.settings.job_expires_s * 1000,
        bound=state.settings.queue_max,
    )


async def _unstore(state: AppState, job: Job) -> None:
    async with state.redis.pipeline(transaction=transactional(state.redis)) as pipe:
        pipe.delete(keys.request(job.request_id))
        pipe.zrem(keys.inflight(job.model), job.request_id)
        await pipe.execute()


async def _store(state: AppState, job: Job) -> None:
    retention = state.settings.retention_s
    async with state.redis.pipeline(transaction=transactional(state.redis)) as pipe:
        pipe.hset(
            keys.request(job.request_id),
            mapping={
                "owner": job.owner,
                "model": job.model,
                "created": repr(job.created),
                "origin": job.origin,
                "job": encode_job(job),
                # read by the start-timeout script, which ends requests it knows only by id
                "store": "1" if job.store else "0",
            },
        )
        pipe.expire(keys.request(job.request_id), retention)
        pipe.zadd(keys.inflight(job.model), {job.request_id: int(job.created * 1000)})
        await pipe.execute()


async def cancel(state: AppState, rid: str) -> None:
    """Raise the cancel flag the worker checks between decode steps.

    Args:
        state: the app state.
        rid: the request id.
    """
    await state.redis.set(keys.cancel(rid), b"1", ex=state.settings.retention_s)
