"""The paged KV pool on the real engine: admission by free blocks, preemption, what never fits.

A tiny random-weight model runs through the real scheduler thread. Sequences are submitted with
an ``emit`` that records, in the decode thread, the order in which their event batches leave, so
"the second request started only after the first finished" is checked without any timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from services.worker.loaders import load_model
from services.worker.sequence import SequenceState
from services.worker.torch_backend import TorchBackend, pool_blocks
from shared.config import Settings
from shared.errors import ContextOverflow
from shared.events import AnyEvent, Error, Finish, Start, is_terminal
from shared.jobs import Job, SamplingParams
from tests.invariants import check_stream, generated_token_ids
from tests.worker_models import write_hf_model

torch.set_num_threads(1)

PROMPT = 40  # tokens per test prompt: three 16-token blocks
NEW = 20  # max_tokens per test job: 60 tokens, four blocks, once done


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    write_hf_model(path, "LlamaForCausalLM", seed=5)
    return path


def job(rid: str, *, prompt: int = PROMPT, max_tokens: int | None = NEW) -> Job:
    salt = sum(map(ord, rid))  # every request its own prompt: no prefix-cache sharing
    return Job(
        request_id=rid,
        model="tiny",
        prompt_token_ids=[(7 * i + salt) % 50 + 3 for i in range(prompt)],
        prompt_text="",
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.0),
    )


def run_together(b: TorchBackend, jobs: list[Job]) -> list[tuple[str, AnyEvent]]:
    """Submit ``jobs`` in one admission round; return (request id, event) in emission order."""
    log: list[tuple[str, AnyEvent]] = []
    done = threading.Semaphore(0)

    def emitter(rid: str) -> Callable[[list[AnyEvent] | BaseException], None]:
        def emit(item: list[AnyEvent] | BaseException) -> None:
            assert not isinstance(item, BaseException), item
            log.extend((rid, e) for e in item)  # runs in the decode thread: a total order
            if any(is_terminal(e) for e in item):
                done.release()

        return emit

    seqs: list[SequenceState] = [
        b._sequence(j, [], 1, emitter(j.request_id), lambda: None) for j in jobs
    ]
    with b.scheduler._cond:  # the loop admits them all in the same round (the lock re-enters)
        for seq in seqs:
            b.scheduler.submit(seq)
    for _ in jobs:
        assert done.acquire(timeout=60)
    for j in jobs:
        events = [e for rid, e in log if rid == j.request_id]
        check_stream(events)
        assert len(generated_token_ids(events)) == (j.max_tokens or 0)
    return log


def first(log: list[tuple[str, AnyEvent]], rid: str, kind: type) -> int:
    return next(i for i, (r, e) in enumerate(log) if r == rid and isinstance(e, kind))


def tokens_of(log: list[tuple[str, AnyEvent]], rid: str) -> list[int]:
    return generated_token_ids([e for r, e in log if r == rid])


async def with_pool(tiny_dir: Path, tokens: int, **kw: int) -> TorchBackend:
    b = TorchBackend(load_model(str(tiny_dir)), max_batch=4, max_cached_tokens=tokens, **kw)
    await b.start()
    return b


def test_settings_and_derived_pool() -> None:
    assert Settings.from_env({}).max_cached_tokens == 0
    assert Settings.from_env({"SLUICE_KV_CACHE_BYTES": "1000000"}).kv_cache_bytes == 1_000_000
    assert Settings.from_env({"SLUICE_KV_BLOCK_SIZE": "32"}).kv_block_size == 32
    assert Settings.from_env({"SLUICE_MAX_BATCHED_TOKENS": "64"}).max_batched_tokens == 64
    # SmolLM2-135M in halves: 30 layers x (k, v) x 3 heads x 64 x 2 bytes = 23 040 a token.
    smollm2 = {"per_token": 23_040, "block_size": 16, "context": 8192}
    assert pool_blocks(kv_bytes=2 * 1024**3, tokens=0, **smollm2) == 5826  # 93 206 tokens
    assert pool_blocks(kv_bytes=1024, tokens=0, **smollm2) == 512  # at least one context
    assert pool_blocks(kv_bytes=2 * 1024**3, tokens=100, **smollm2) == 7  # tokens win


async def test_defaults_fit_the_hardware(tiny_dir: Path) -> None:
    b = TorchBackend(load_model(str(tiny_dir)))
    assert b.max_batch == 64 and b.scheduler.max_batched_tokens == 512  # the CPU's defaults
    assert b.scheduler.max_cached_tokens >= 256  # at least the tiny model's context


async def test_a_request_waits_for_blocks_instead_of_failing(tiny_dir: Path) -> None:
    b = await with_pool(tiny_dir, 80)  # five blocks: a's three and a watermark leave one
    try:
        log = run_together(b, [job("a"), job("b")])
        assert first(log, "b", Start) > first(log, "a", Finish)  # b was queued, then joined
        assert b.scheduler.cache.pool.used == 0 and b.scheduler.waiting == 0
        assert b.scheduler.preemptions == 0
    finally:
        await b.stop()


async def test_requests_that_fit_together_run_together(tiny_dir: Path) -> None:
    b = await with_pool(tiny_dir, 16 * 9)  # 9 blocks: two finished sequences hold 8
    try:
        log = run_together(b, [job("a"), job("b"), job("c")])
        assert first(log, "b", Start) < first(log, "a", Finish)
        assert first(log, "c", Start) > min(first(log, "a", Finish), first(log, "b", Finish))
        assert b.scheduler.preemptions == 0
    finally:
        await b.stop()


async def test_a_dry_pool_preempts_the_latest_and_its_output_is_unchanged(
    tiny_dir: Path,
) -> None:
    jobs = [job("a", max_tokens=60), job("b", max_tokens=60)]  # 100 tokens each, 7 blocks
    alone = await with_pool(tiny_dir, 16 * 32)
    try:
        expected = {j.request_id: tokens_of(run_together(alone, [j]), j.request_id) for j in jobs}
    finally:
        await alone.stop()
    b = await with_pool(tiny_dir, 16 * 10)  # both start (3 blocks each), both cannot finish
    try:
        log = run_together(b, jobs)
        assert b.scheduler.preemptions >= 1
        assert first(log, "b", Start) < first(log, "a", Finish)  # b ran, then paused for a
        for rid, tokens in expected.items():
            assert tokens_of(log, rid) == tokens, f"{rid}'s output changed when preempted"
        starts = [e for r, e in log if isinstance(e, Start)]
        assert len(starts) == 2  # a preempted stream pauses: no second Start, no error
    finally:
        await b.stop()


async def test_a_request_that_can_never_fit_is_a_context_overflow(tiny_dir: Path) -> None:
    b = await with_pool(tiny_dir, 100)  # seven blocks: 112 tokens
    try:
        with pytest.raises(ContextOverflow, match="112-token KV cache"):
            async for _ in b.generate(job("big", max_tokens=73), [], 1):
                pass
        with pytest.raises(ContextOverflow):
            async for _ in b.generate(job("long", prompt=112, max_tokens=None), [], 1):
                pass
        # Without max_tokens a request may generate up to the pool, then stops.
        events: list[AnyEvent] = []
        async for batch in b.generate(job("open", max_tokens=None), [], 1):
            events += batch
        check_stream(events)
        assert len(generated_token_ids(events)) == 112 - PROMPT
        assert isinstance(events[-1], Finish) and events[-1].reason == "max_tokens"
    finally:
        await b.stop()


@pytest.mark.integration
async def test_overflow_reaches_the_stream_as_an_error(
    redis: aioredis.Redis, redis_url: str, tiny_dir: Path
) -> None:
    from tests.integration.test_worker_bus import read_stream, submit
    from tests.integration.worker_harness import running_worker

    overrides = {"max_cached_tokens": 100, "max_batch": 2, "device": "cpu", "dtype": "float32"}
    async with running_worker(redis_url, str(tiny_dir), overrides, name="tiny") as worker:
        assert await submit(redis_url, job("big", max_tokens=80))
        events = await read_stream(redis, "big")
        check_stream(events)
        assert len(events) == 1 and isinstance(events[0], Error)
        assert events[0].kind == "context_overflow" and not events[0].retryable
        assert "112-token KV cache" in events[0].message
        assert await submit(redis_url, job("fits"))
        events = await read_stream(redis, "fits")
        check_stream(events)
        assert isinstance(events[-1], Finish)
        assert worker.name == "tiny"
