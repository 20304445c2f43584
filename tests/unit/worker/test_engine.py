"""The torch backend end to end on CPU: events, batching, seeds, cancellation, resume, prefixes.

Tiny random-weight models and the forced-sequence double run through the real scheduler thread,
tokenizer and output decoder, on prompts rendered and tokenized as the API does. Every stream
goes through ``check_stream``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.worker.loaders import load_model
from services.worker.torch_backend import TorchBackend
from shared.errors import ContextOverflow
from shared.events import (
    AnyEvent,
    Finish,
    ReasoningDelta,
    ReasoningEnd,
    Start,
    TextDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart, ToolDef
from tests.forced_model import forced_backend
from tests.invariants import check_stream, generated_token_ids
from tests.job_factory import as_job
from tests.worker_models import tiny_tokenizer, write_hf_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    write_hf_model(path, "Qwen3ForCausalLM", seed=11)
    return path


@pytest.fixture
async def backend(tiny_dir: Path) -> AsyncIterator[TorchBackend]:
    b = TorchBackend(load_model(str(tiny_dir)), max_batch=4)
    await b.start()
    yield b
    await b.stop()


def job(text: str = "Hello world", rid: str = "r1", **kw: object) -> GenerateRequest:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    ids = kw.pop("prompt_token_ids", None)
    request = GenerateRequest(
        request_id=rid,
        model="tiny",
        messages=[Message(role="user", content=[TextPart(text=text)])],
        **kw,  # type: ignore[arg-type]
    )
    if ids is None:
        return request  # rendered for the backend that runs it (as_job)
    return Job.of(request, prompt_token_ids=ids, prompt_text="")  # type: ignore[arg-type]


async def run(
    b: TorchBackend, j: GenerateRequest, resume: list[int] | None = None, attempt: int = 1
) -> list[AnyEvent]:
    events: list[AnyEvent] = []
    async for batch in b.generate(as_job(j, b), resume or [], attempt):
        events.extend(batch)
    check_stream(events)
    return events


async def test_generates_a_valid_stream(backend: TorchBackend) -> None:
    events = await run(backend, job(max_tokens=12, ignore_eos=True))
    start, usage, finish = events[0], events[-2], events[-1]
    assert isinstance(start, Start) and start.request_id == "r1" and start.prompt_tokens > 5
    assert isinstance(usage, Usage) and usage.output_tokens == 12
    assert isinstance(finish, Finish) and finish.reason == "max_tokens"
    assert len(generated_token_ids(events)) == 12
    assert backend.scheduler.active == 0


async def test_concurrent_greedy_equals_alone(backend: TorchBackend) -> None:
    texts = ["Hello world", "The capital of France is", "What is the weather in Paris today?"]
    jobs = [job(t, f"r{i}", max_tokens=10, ignore_eos=True) for i, t in enumerate(texts)]
    alone = [generated_token_ids(await run(backend, j)) for j in jobs]
    backend.scheduler.clear_prefix_cache()  # no prefix reuse
    together = await asyncio.gather(*(run(backend, j) for j in jobs))
    assert [generated_token_ids(e) for e in together] == alone
    assert all(isinstance(e[0], Start) and e[0].cached_tokens == 0 for e in together)


async def test_seeded_sampling_is_reproducible(backend: TorchBackend) -> None:
    def seeded(seed: int) -> GenerateRequest:
        return job(
            max_tokens=15,
            ignore_eos=True,
            sampling=SamplingParams(temperature=1.0, top_k=50, seed=seed),
        )

    first = generated_token_ids(await run(backend, seeded(1)))
    again = generated_token_ids(await run(backend, seeded(1)))
    other = generated_token_ids(await run(backend, seeded(2)))
    assert first == again
    assert first != other


async def test_prefix_reuse_reports_cached_tokens(backend: TorchBackend) -> None:
    text = "The same question about the weather in Paris, asked twice by two callers"
    first = await run(backend, job(text, max_tokens=6, ignore_eos=True))
    second = await run(backend, job(text, max_tokens=6, ignore_eos=True))
    s1, s2 = first[0], second[0]
    assert isinstance(s1, Start) and isinstance(s2, Start)
    assert s1.cached_tokens == 0 and s2.prompt_tokens > 32
    size = backend.scheduler.cache.block_size  # whole blocks, the last token always computed
    assert s2.cached_tokens == (s2.prompt_tokens - 1) // size * size
    u2 = second[-2]
    assert isinstance(u2, Usage) and u2.cached_tokens == s2.cached_tokens
    assert generated_token_ids(first) == generated_token_ids(second)


async def test_cancellation_frees_the_blocks(backend: TorchBackend) -> None:
    gen = backend.generate(as_job(job(max_tokens=200, ignore_eos=True), backend), [], 1)
    first = await anext(gen)
    assert isinstance(first[0], Start)
    assert backend.scheduler.active == 1
    await gen.aclose()
    assert backend.scheduler.active == 0
    assert backend.scheduler.cache.pool.used == 0  # its full blocks stay cached, held by none


async def test_cancel_while_queued(tiny_dir: Path) -> None:
    b = TorchBackend(load_model(str(tiny_dir)), max_batch=1)
    await b.start()
    try:
        running = b.generate(as_job(job(max_tokens=100, ignore_eos=True), b), [], 1)
        await anext(running)
        queued = b.generate(as_job(job("other", "r2", max_tokens=5), b), [], 1)
        waiter = asyncio.ensure_future(anext(queued))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await queued.aclose()
        await running.aclose()
        assert b.scheduler.active == 0
        events = await run(b, job(max_tokens=3))  # the slot serves the next job
        assert isinstance(events[-1], Finish)
    finally:
        await b.stop()


async def test_resume_continues_the_same_tokens(backend: TorchBackend) -> None:
    events = await run(backend, job(max_tokens=10, ignore_eos=True))
    full = generated_token_ids(events)
    # A lost worker published whole events: cut after the third delta.
    cut = len(generated_token_ids(events[:4]))
    assert 0 < cut < len(full)
    backend.scheduler.clear_prefix_cache()
    rest = await run(backend, job(max_tokens=10, ignore_eos=True), resume=full[:cut], attempt=2)
    start, usage = rest[0], rest[-2]
    assert isinstance(start, Start) and start.attempt == 2
    assert generated_token_ids(rest) == full[cut:]
    assert isinstance(usage, Usage) and usage.output_tokens == 10


async def test_logprobs(backend: TorchBackend) -> None:
    events = await run(
        backend,
        job(
            max_tokens=4,
            ignore_eos=True,
            sampling=SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
        ),
    )
    logprobs = [lp for e in events if isinstance(e, TextDelta) for lp in e.logprobs or []]
    assert logprobs
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.logprob <= 0.0
        assert lp.logprob == pytest.approx(lp.top[0].logprob)  # greedy picks the top token


async def test_prompt_token_ids_and_context_limits(backend: TorchBackend) -> None:
    ctx = backend.scheduler.context_length
    with pytest.raises(ContextOverflow):
        await run(backend, job(prompt_token_ids=[5] * ctx))
    events = await run(backend, job(prompt_token_ids=[5] * (ctx - 3), ignore_eos=True))
    assert isinstance(events[0], Start) and events[0].prompt_tokens == ctx - 3
    assert isinstance(events[-1], Finish) and events[-1].reason == "max_tokens"
    assert len(generated_token_ids(events)) == 3  # stopped by the context, not max_tokens


# -- the forced-sequence double: deterministic reasoning / tool / stop / eos paths -------------


WEATHER = ToolDef(name="get_weather", parameters={"type": "object"})


async def test_forced_reasoning_and_tool_call() -> None:
    b = forced_backend(
        '<think>Need the weather.</think><tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}</tool_call><|im_end|>'
    )
    await b.start()
    try:
        events = await run(b, job("Weather in Paris?", tools=[WEATHER], max_tokens=100))
    finally:
        await b.stop()
    kinds = [type(e) for e in events]
    assert ReasoningDelta in kinds and ReasoningEnd in kinds
    text = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert text == "Need the weather."
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [s.name for s in starts] == ["get_weather"]
    assert [e.arguments.replace(" ", "") for e in ends] == ['{"city":"Paris"}']
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "tool_use"


async def test_forced_stop_sequence_is_not_leaked() -> None:
    b = forced_backend("Hello there STOP and more words<|im_end|>")
    await b.start()
    try:
        events = await run(b, job(stop=["STOP"], max_tokens=50))
    finally:
        await b.stop()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "STOP" not in text and text.startswith("Hello there")
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "stop_sequence"
    assert b.scheduler.active == 0


async def test_forced_eos_min_tokens_and_ignore_eos() -> None:
    b = forced_backend("Hi<|im_end|>")
    await b.start()
    try:
        plain = await run(b, job(max_tokens=20))
        at_least = await run(b, job(max_tokens=20, min_tokens=6))
        ignoring = await run(b, job(max_tokens=9, ignore_eos=True))
    finally:
        await b.stop()
    assert isinstance(plain[-1], Finish) and plain[-1].reason == "end_turn"
    assert len(generated_token_ids(plain)) == len(tiny_tokenizer().encode("Hi<|im_end|>").ids)
    assert len(generated_token_ids(at_least)) >= 6
    assert 2 not in generated_token_ids(at_least)[:6]
    assert isinstance(ignoring[-1], Finish) and ignoring[-1].reason == "max_tokens"
    assert 2 not in generated_token_ids(ignoring)


async def test_engine_metrics_observe_steps_and_return_to_idle(tiny_dir: Path) -> None:
    from prometheus_client import generate_latest

    from services.worker.metrics import WorkerMetrics
    from tests.metrics_text import sample

    b = TorchBackend(load_model(str(tiny_dir)), max_batch=4)
    metrics = WorkerMetrics()
    metrics.bind(
        model="tiny", wid="w", device=b.device, version="t", running=lambda: 0.0, engine=b.scheduler
    )
    kv_while_running: list[float] = []

    async def one(rid: str) -> list[AnyEvent]:
        events: list[AnyEvent] = []
        async for batch in b.generate(
            as_job(job(rid=rid, max_tokens=8, ignore_eos=True), b), [], 1
        ):
            kv_while_running.append(sample(generate_latest(metrics.registry).decode(),
                                           "sluice_kv_cache_usage_perc", model="tiny"))  # fmt: skip
            events.extend(batch)
        return events

    await b.start()
    try:
        streams = await asyncio.gather(one("a"), one("b"), one("c"))
    finally:
        await b.stop()
    text = generate_latest(metrics.registry).decode()
    # a step counts every sequence it advanced, a prompt's last chunk (the first token) included
    decoded = sum(len(generated_token_ids(s)) for s in streams)
    assert sample(text, "sluice_decode_batch_size_sum", model="tiny") == decoded
    steps = sample(text, "sluice_decode_step_seconds_count", model="tiny")
    assert 0 < steps <= decoded  # batched: fewer steps than decoded tokens when they overlap
    assert sample(text, "sluice_decode_step_seconds_sum", model="tiny") > 0
    assert max(kv_while_running) > 0
    assert sample(text, "sluice_kv_cache_usage_perc", model="tiny") == 0  # idle again
    assert sample(text, "sluice_num_requests_waiting_engine", model="tiny") == 0
    assert sample(text, "sluice_worker_info", device="cpu") == 1


async def test_a_failing_sequence_fails_alone(backend: TorchBackend) -> None:
    """A per-sequence failure (here top_logprobs beyond the vocabulary, which the API refuses
    but the worker must survive) ends that request only; its batch-mates finish unchanged."""
    good = job("The capital of France is", "good", max_tokens=10, ignore_eos=True)
    alone = generated_token_ids(await run(backend, good))
    backend.scheduler.clear_prefix_cache()
    poison = job(
        "Hello world",
        "poison",
        max_tokens=10,
        sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=100_000),
    )
    outcomes = await asyncio.gather(
        run(backend, good), run(backend, poison), return_exceptions=True
    )
    assert isinstance(outcomes[1], Exception), outcomes[1]
    assert not isinstance(outcomes[0], BaseException), outcomes[0]
    assert generated_token_ids(outcomes[0]) == alone
    assert backend.scheduler.active == 0
    assert generated_token_ids(await run(backend, good)) == alone  # and the worker goes on
