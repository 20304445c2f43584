"""Greedy output invariance checks shared by the tiny-model and the default-model tests.

One request's greedy tokens and log-probabilities (the logits' own bits, through
``log_softmax``) are collected from the real ``TorchBackend`` (scheduler thread, paged cache,
prefix cache, chunked prefill mixed with decode, continuous batching) under each condition that
must not change them: alone, with one and three blocks of the prompt served from the prefix cache,
decoded in a batch of 16 beside other requests, prefilled in chunks of 1, 7 and the whole prompt,
prefilled on 1 and 3 threads (``SLUICE_PREFILL_THREADS``), preempted after its first token and
half way (its blocks taken back, recomputed from its tokens), and continued from the middle as a
failover does (prompt + the tokens already generated prefilled on a fresh cache, then decoded).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from services.worker import kernels
from services.worker.paging import Planner
from services.worker.torch_backend import TorchBackend
from shared.events import AnyEvent
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart
from tests.invariants import check_stream, generated_token_ids

__all__ = ["Greedy", "check_invariance", "greedy"]


@dataclass(frozen=True)
class Greedy:
    """A run's generated tokens and, per token, its log-probability and the top alternatives."""

    tokens: list[int]
    logprobs: list[tuple[float, tuple[float, ...]]]


def _job(ids: list[int], max_tokens: int, rid: str) -> Job:
    request = GenerateRequest(
        request_id=rid,
        model="m",
        messages=[Message(role="user", content=[TextPart(text="-")])],
        sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        max_tokens=max_tokens,
        ignore_eos=True,
    )
    return Job.of(request, prompt_token_ids=ids, prompt_text="")


async def greedy(
    b: TorchBackend,
    ids: list[int],
    max_tokens: int,
    resume: list[int] | None = None,
    rid: str = "r",
) -> Greedy:
    """Run one greedy request (``resume``: continue after those tokens, as a failover does)."""
    events: list[AnyEvent] = []
    async for batch in b.generate(_job(ids, max_tokens, rid), resume or [], 1 + bool(resume)):
        events.extend(batch)
    check_stream(events)
    probs = [
        (lp.logprob, tuple(t.logprob for t in lp.top))
        for e in events
        for lp in (getattr(e, "logprobs", None) or [])
    ]
    return Greedy(generated_token_ids(events), probs)


def preempt_once(patch: pytest.MonkeyPatch, planner: Planner, after: int) -> None:
    """Make the planner preempt the request ``preempted`` once, as a dry pool would (at the
    start of a step), once it has generated ``after`` tokens (or more: a speculating sequence
    may take several in one step)."""
    plan = planner.plan

    def plan_then_preempt() -> list:  # type: ignore[type-arg]
        for seq in list(planner.active):
            if seq.job.request_id == "preempted" and seq.generated >= after and not seq.preempted:
                planner.preempt(seq)
        return plan()

    patch.setattr(planner, "plan", plan_then_preempt)
    patch.setattr(planner, "preemptions", 0)


def _forget(b: TorchBackend) -> None:
    """Empty the prefix cache: the next request prefills its whole prompt."""
    b.scheduler.clear_prefix_cache()


async def check_invariance(
    b: TorchBackend, ids: list[int], vocab: int, max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Assert every condition gives the same tokens and log-probabilities as the run alone.

    ``b`` needs 16 slots; ``ids`` at least 54 prompt tokens (50 reused and a few more)."""
    assert b.max_batch >= 16 and len(ids) > 53
    _forget(b)
    alone = await greedy(b, ids, max_tokens)
    assert len(alone.tokens) == max_tokens and alone.logprobs  # (markers carry no logprobs)

    size = b.scheduler.cache.block_size
    for reused in (size, 3 * size + 2):  # a finished request left `reused` tokens to share
        _forget(b)
        other = [*ids[:reused], (ids[reused] + 1) % vocab]
        await greedy(b, other, 1, rid="prefix")
        got = await greedy(b, ids, max_tokens)
        assert got == alone, f"{reused} prompt tokens from the prefix cache changed the output"

    _forget(b)  # a batch of 16: 15 other prompts of other lengths decode beside this one
    others = [[(t * (i + 3) + i) % vocab for t in ids[: 20 + 3 * i]] for i in range(15)]
    runs = await asyncio.gather(
        *(greedy(b, o, 2 * max_tokens + 16, rid=f"o{i}") for i, o in enumerate(others)),
        greedy(b, ids, max_tokens, rid="mine"),
    )
    assert runs[-1] == alone, "decoding in a batch of 16 changed the output"

    for chunk in (1, 7):  # whole: the runs above (the prompt fits one step's token budget)
        _forget(b)
        with monkeypatch.context() as patch:
            patch.setattr(b.scheduler.planner, "max_batched_tokens", chunk)
            got = await greedy(b, ids, max_tokens)
        assert got == alone, f"prefill in chunks of {chunk} changed the output"

    for after in (1, max_tokens // 2):  # preempted, then recomputed from its tokens
        _forget(b)
        with monkeypatch.context() as patch:
            preempt_once(patch, b.scheduler.planner, after)
            got = await greedy(b, ids, max_tokens, rid="preempted")
            assert b.scheduler.planner.preemptions == 1, "the preemption did not happen"
        assert got == alone, f"a preemption after {after} tokens changed the output"

    built = kernels.load()  # the process's kernels, which the model runs on
    for threads in (1, 3):  # the split of a prompt chunk's rows between threads
        _forget(b)
        with monkeypatch.context() as patch:
            patch.setattr(built, "prefill_threads", threads)
            got = await greedy(b, ids, max_tokens)
        assert got == alone, f"prefill on {threads} threads changed the output"

    for k in (1, max_tokens // 2):  # failover: prompt + k generated tokens prefilled afresh
        _forget(b)
        got = await greedy(b, ids, max_tokens, resume=alone.tokens[:k])
        assert got.tokens == alone.tokens[k:], f"a continuation after {k} tokens diverged"
        tail = len(alone.logprobs) - len(got.logprobs)  # (reasoning tokens carry none)
        assert tail >= 0 and got.logprobs == alone.logprobs[tail:]
