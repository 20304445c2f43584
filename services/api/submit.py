"""Admission: validate a canonical request, render and tokenize it into a job, store, enqueue.

Every wire route ends in ``submit``. The checks run in order of cost and nothing is written to
Redis until all of them pass, so a rejected request leaves no trace: unknown model (404), no
live worker (503), prompt too long for the context (400), queue full (429 with Retry-After);
a Redis that refuses the writes for want of memory is a 503 with Retry-After too.
Then one pipeline stores the request hash and the in-flight entry, and the job goes onto the
model's queue (``services.queue``) with ``job id = request id`` (a duplicate enqueue is a no-op)
and a msgpack payload: the bound is checked in the same atomic step as the enqueue (a refused
request's hash and in-flight entry are removed again).

A request with ``n`` choices (Chat, legacy Completions) is rendered once and fanned out into n
jobs, ``shared.jobs.choice_id(rid, i)``, each with its own request hash, in-flight entry, stream
and lease, so failover, the start timeout and cancellation work per choice as for any request.
They are enqueued all or none (``Queue.enqueue_all``) and take n places of the queue's bound.
With a ``seed``, choice i samples with ``seed + i`` (``shared.jobs.choice_seed``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
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
from shared.jobs import GenerateRequest, Job, choice_id, choice_seed
from shared.prefix import prompt_chain
from shared.prompt import NestingError, PromptRenderer, RenderedPrompt

if TYPE_CHECKING:
    from services.api.state import AppState

__all__ = ["cancel", "choice_jobs", "new_request_id", "render_prompt", "submit"]


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
    prompt: RenderedPrompt | list[RenderedPrompt] | None = None,
) -> Job:
    """Validate, render and tokenize a request, then store and enqueue it as a ``Job``.

    Args:
        state: the app state.
        job: the canonical request; ``request_id`` may be empty (one is assigned).
        owner: the caller's owner id from ``authenticate``; None keeps ``job.owner``.
        prompt: the prompt already tokenized (legacy completions: raw text, no template), or
            a batch's prompts (``job.prompts`` of them); None renders ``job.messages`` through
            the chat template.

    Returns:
        The job as enqueued: the request with ``request_id``, ``prompt_token_ids``,
        ``prompt_text``, ``owner`` and ``created`` filled in (choice 0's when ``job.n`` > 1;
        ``choice_jobs`` gives the others).

    Raises:
        InvalidRequest: ``n`` (per prompt) is below 1 or above ``SLUICE_MAX_N``, or a batch
            has more choices than the queue holds.
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
    state: AppState,
    job: GenerateRequest,
    owner: str | None,
    prompt: RenderedPrompt | list[RenderedPrompt] | None,
) -> Job:
    if not 1 <= job.n // job.prompts <= state.settings.max_n:
        raise InvalidRequest(f"n must be between 1 and {state.settings.max_n}", param="n")
    if job.n > 1 and job.n > state.settings.queue_max:
        # all or nothing, so a batch larger than the queue could never be admitted: say so now
        raise InvalidRequest(
            f"{job.n} completions in one request exceed the queue's {state.settings.queue_max}",
            param="prompt",
        )
    loaded = await state.cards.get(job.model)
    if not await state.cards.has_worker(job.model):
        raise NoWorker(f"no worker is serving '{job.model}' right now", retry_after=5)
    if job.max_tokens is not None and job.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    batch = (
        prompt
        if isinstance(prompt, list)
        else [prompt or await render_prompt(loaded.renderer, job)]
    )
    rendered = max(batch, key=lambda p: len(p.token_ids))  # the one that must fit
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
    if queued + job.n > state.settings.queue_max:
        raise RateLimited(f"the queue for '{job.model}' is full ({queued} requests)", retry_after=1)
    rid = job.request_id or new_request_id()
    request = msgspec.structs.replace(
        job, request_id=rid, owner=job.owner if owner is None else owner, created=time.time()
    )
    first = batch[0]
    tokenized = Job.of(request, prompt_token_ids=list(first.token_ids), prompt_text=first.text)
    if (rec := access.record()) is not None:
        rec.request_id, rec.model = rid, job.model
    logs.bind(request_id=rid, model=job.model)
    jobs = choice_jobs(tokenized, batch)
    sent = time.perf_counter()
    try:
        await _store(state, jobs)
        enqueued = await _enqueue(state, jobs)
    except ResponseError as exc:
        if not is_oom(exc):
            raise
        # Redis is full (maxmemory, noeviction): nothing was queued, so the client may retry
        # once memory is freed. The hash may be stored already; deleting is allowed when full,
        # and must happen: a sweeper would otherwise take the in-flight entry for a lost run.
        await _unstore(state, jobs)
        raise Unavailable(OOM_MESSAGE, retry_after=1) from exc
    if enqueued == QUEUE_FULL:
        await _unstore(state, jobs)
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


def choice_jobs(job: Job, prompts: Sequence[RenderedPrompt] = ()) -> list[Job]:
    """The jobs of a request's choices: ``job`` itself, then one per further choice, each under
    its derived id with its own seed, and, in a prompt batch, its own prompt.

    Args:
        job: the request's job (choice 0).
        prompts: a batch's prompts (``job.prompts`` of them, each for ``job.n // job.prompts``
            choices in a row); empty or one: every choice has ``job``'s prompt.

    Returns:
        ``job.n`` jobs, choice 0 first.
    """
    per_prompt = job.n // job.prompts
    jobs = [job]
    for i in range(1, job.n):
        choice = msgspec.structs.replace(
            job,
            request_id=choice_id(job.request_id, i),
            choice=i,
            sampling=msgspec.structs.replace(job.sampling, seed=choice_seed(job.sampling.seed, i)),
        )
        if len(prompts) > 1:
            own = prompts[i // per_prompt]
            choice = msgspec.structs.replace(
                choice, prompt_token_ids=list(own.token_ids), prompt_text=own.text
            )
        jobs.append(choice)
    return jobs


async def _enqueue(state: AppState, jobs: list[Job]) -> int:
    """The queue's enqueue (job id = request id, a duplicate is a no-op) with the queue bound
    checked atomically: the ``size`` above is only a cheap early refusal, and a burst would pass
    it all at once. A request's choices go in together or not at all."""
    job = jobs[0]
    now_ms, expires_ms = int(time.time() * 1000), state.settings.job_expires_s * 1000
    bound = state.settings.queue_max
    if len(jobs) > 1:
        payloads = [(j.request_id, encode_job(j)) for j in jobs]
        return await state.queue.enqueue_all(
            job.model, payloads, enqueue_ms=now_ms, expires_ms=expires_ms, bound=bound
        )
    return await state.queue.enqueue(
        job.model,
        job.request_id,
        encode_job(job),
        enqueue_ms=now_ms,
        expires_ms=expires_ms,
        bound=bound,
        prefix=_prefix(state, job),
        affinity_wait_ms=state.settings.affinity_wait_ms,
    )


def _prefix(state: AppState, job: Job) -> list[bytes] | None:
    """The prompt's block hash chain, as the workers' prefix caches name its blocks, for the
    queue's cache-aware pickup (None when it is off). ~55 ns a token: 0.2 ms for 3,500."""
    if state.settings.affinity_wait_ms <= 0:
        return None
    return prompt_chain(job.model, job.prompt_token_ids, state.settings.kv_block_size)


async def _unstore(state: AppState, jobs: list[Job]) -> None:
    async with state.redis.pipeline(transaction=transactional(state.redis)) as pipe:
        for job in jobs:
            pipe.delete(keys.request(job.request_id))
            pipe.zrem(keys.inflight(job.model), job.request_id)
        await pipe.execute()


async def _store(state: AppState, jobs: list[Job]) -> None:
    retention = state.settings.retention_s
    async with state.redis.pipeline(transaction=transactional(state.redis)) as pipe:
        for job in jobs:
            pipe.hset(
                keys.request(job.request_id),
                mapping={
                    "owner": job.owner,
                    "model": job.model,
                    "created": repr(job.created),
                    # The start deadline is the request's own, fixed when it was admitted: every
                    # API replica and sweep ends it at the same moment, whatever their settings.
                    "start_by": repr(job.created + state.settings.start_timeout_s),
                    "origin": job.origin,
                    "job": encode_job(job),
                    # read by the start-timeout script, which ends requests it knows only by id
                    "store": "1" if job.store else "0",
                },
            )
            pipe.expire(keys.request(job.request_id), retention)
            pipe.zadd(keys.inflight(job.model), {job.request_id: int(job.created * 1000)})
        await pipe.execute()


async def cancel(state: AppState, *rids: str) -> None:
    """Raise the cancel flag the worker checks between decode steps.

    Args:
        state: the app state.
        rids: the request ids (every choice of a request with ``n`` > 1).
    """
    async with state.redis.pipeline(transaction=False) as pipe:
        for rid in rids:
            pipe.set(keys.cancel(rid), b"1", ex=state.settings.retention_s)
        await pipe.execute()
