"""The bound on total cached tokens: queued until there is room, rejected only if never.

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
from services.worker.scheduler import SequenceState
from services.worker.torch_backend import TorchBackend, derive_max_cached_tokens
from shared.config import Settings
from shared.errors import ContextOverflow
from shared.events import AnyEvent, Error, Finish, Start, is_terminal
from shared.jobs import Job, SamplingParams
from tests.invariants import check_stream, generated_token_ids
from tests.worker_models import write_hf_model

torch.set_num_threads(1)

PROMPT = 40  # tokens per test prompt
NEW = 20  # max_tokens per test job: each job reserves PROMPT + NEW = 60 tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    write_hf_model(path, "LlamaForCausalLM", seed=5)
    return path


def job(rid: str, *, prompt: int = PROMPT, max_tokens: int | None = NEW) -> Job:
    return Job(
        request_id=rid,
        model="tiny",
        prompt_token_ids=[(7 * i) % 50 + 3 for i in range(prompt)],
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
        assert len(generated_token_ids(events)) == NEW
    return log


def first(log: list[tuple[str, AnyEvent]], rid: str, kind: type) -> int:
    return next(i for i, (r, e) in enumerate(log) if r == rid and isinstance(e, kind))


async def with_budget(tiny_dir: Path, budget: int) -> TorchBackend:
    b = TorchBackend(load_model(str(tiny_dir)), max_batch=4, max_cached_tokens=budget)
    await b.start()
    return b


def test_setting_and_derived_default() -> None:
    assert Settings.from_env({}).max_cached_tokens == 0
    assert Settings.from_env({"SLUICE_MAX_CACHED_TOKENS": "300"}).max_cached_tokens == 300
    smollm2 = {"layers": 30, "kv_heads": 3, "head_dim": 64, "context": 8192}
    # 30 layers x (k, v) x 3 heads x 64 x 4 bytes = 46 080 bytes per token; 2 GiB holds 46 603.
    assert derive_max_cached_tokens(**smollm2, dtype=torch.float32, slots=16) == 46_603
    assert derive_max_cached_tokens(**smollm2, dtype=torch.bfloat16, slots=16) == 93_206
    assert derive_max_cached_tokens(**smollm2, dtype=torch.float32, slots=2) == 2 * 8192
    huge = {"layers": 80, "kv_heads": 64, "head_dim": 128, "context": 8192}
    assert derive_max_cached_tokens(**huge, dtype=torch.float32, slots=16) == 8192


async def test_zero_derives_the_budget(tiny_dir: Path) -> None:
    b = TorchBackend(load_model(str(tiny_dir)), max_batch=4)
    assert b.scheduler.max_cached_tokens == 4 * 256  # tiny: every slot may hold its context


async def test_a_request_waits_for_room_instead_of_failing(tiny_dir: Path) -> None:
    b = await with_budget(tiny_dir, 100)  # room for one 60-token reservation, not two
    try:
        log = run_together(b, [job("a"), job("b")])
        assert first(log, "b", Start) > first(log, "a", Finish)  # b was queued, then joined
        assert b.scheduler.reserved == 0 and b.scheduler.waiting == 0
    finally:
        await b.stop()


async def test_requests_that_fit_together_run_together(tiny_dir: Path) -> None:
    b = await with_budget(tiny_dir, 120)  # exactly two reservations
    try:
        log = run_together(b, [job("a"), job("b"), job("c")])
        assert first(log, "b", Start) < first(log, "a", Finish)
        assert first(log, "c", Start) > min(first(log, "a", Finish), first(log, "b", Finish))
    finally:
        await b.stop()


async def test_a_request_that_can_never_fit_is_a_context_overflow(tiny_dir: Path) -> None:
    b = await with_budget(tiny_dir, 100)
    try:
        with pytest.raises(ContextOverflow, match="100-token cache budget"):
            async for _ in b.generate(job("big", max_tokens=61), [], 1):
                pass
        with pytest.raises(ContextOverflow):
            async for _ in b.generate(job("long", prompt=100, max_tokens=None), [], 1):
                pass
        # Without max_tokens a request may generate up to the budget, then stops.
        events: list[AnyEvent] = []
        async for batch in b.generate(job("open", max_tokens=None), [], 1):
            events += batch
        check_stream(events)
        assert len(generated_token_ids(events)) == 100 - PROMPT
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
        assert "100-token cache budget" in events[0].message
        assert await submit(redis_url, job("fits"))
        events = await read_stream(redis, "fits")
        check_stream(events)
        assert isinstance(events[-1], Finish)
        assert worker.name == "tiny"
