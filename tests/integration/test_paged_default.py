"""The paged KV cache on the real default model (SmolLM2-135M Q4_1 on the CPU kernels).

Agent traffic: sessions sharing a system prompt, a multi-turn session whose next turn reuses the
previous answer, 64 streams at once on one worker, a pool small enough to force preemption
(outputs equal to the unpreempted run), and a long prompt arriving while streams decode (spread
over steps that each carry every stream's token). Nothing here is timed: the benchmark
(``ops/bench/agent_sessions.py``) measures speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
import torch

from services.worker.sequence import SequenceState
from services.worker.torch_backend import TorchBackend
from shared.config import Settings
from shared.events import AnyEvent, Start, TextDelta, Usage
from shared.jobs import GenerateRequest, Message, SamplingParams, TextPart
from tests.invariants import generated_token_ids
from tests.job_factory import as_job, run

pytestmark = pytest.mark.slow

SYSTEM = " ".join(
    f"Rule {i}: answer briefly, cite the tool you used, and never invent a file path."
    for i in range(12)
)  # about 200 tokens, shared by every session


def load(**settings: object) -> TorchBackend:
    torch.set_num_threads(2)
    return TorchBackend.load(Settings(device="cpu", **settings), "smollm2", None)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def loaded() -> TorchBackend:
    return load()


@pytest.fixture
async def backend(loaded: TorchBackend) -> AsyncIterator[TorchBackend]:
    loaded.scheduler.clear_prefix_cache()
    await loaded.start()
    yield loaded
    await loaded.stop()


def session(turns: list[str], answers: list[str], rid: str, max_tokens: int) -> GenerateRequest:
    messages = [Message(role="system", content=[TextPart(text=SYSTEM)])]
    for i, user in enumerate(turns):
        messages.append(Message(role="user", content=[TextPart(text=user)]))
        if i < len(answers):
            messages.append(Message(role="assistant", content=[TextPart(text=answers[i])]))
    return GenerateRequest(
        request_id=rid,
        model="smollm2",
        messages=messages,
        sampling=SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def cached(events: list[AnyEvent]) -> tuple[int, int]:
    start, usage = events[0], next(e for e in events if isinstance(e, Usage))
    assert isinstance(start, Start) and usage.cached_tokens == start.cached_tokens
    return start.cached_tokens, start.prompt_tokens


async def test_sessions_sharing_a_system_prompt_compute_it_once(backend: TorchBackend) -> None:
    shared_len = len(as_job(session(["x"], [], "probe", 1), backend).prompt_token_ids) - 8
    first = await run(backend, session(["What is in /etc?"], [], "a", 4))
    assert cached(first)[0] == 0
    second = await run(backend, session(["List the tools."], [], "b", 4))
    assert cached(second)[0] >= shared_len // 16 * 16 - 16  # the system prompt's whole blocks
    backend.scheduler.clear_prefix_cache()
    together = await asyncio.gather(  # arriving at once: all but the first wait for its blocks
        *(run(backend, session([f"Question {i}?"], [], f"s{i}", 4)) for i in range(4))
    )
    hits = sorted(cached(events)[0] for events in together)
    assert hits[0] == 0 and all(h >= shared_len // 16 * 16 - 16 for h in hits[1:])


async def test_turn_two_reuses_turn_one_and_its_answer(backend: TorchBackend) -> None:
    one = await run(backend, session(["Name a planet."], [], "t1", 40))
    answer = "".join(e.text for e in one if isinstance(e, TextDelta))
    turn1_prompt = cached(one)[1]
    two = await run(backend, session(["Name a planet.", "And a moon?"], [answer], "t2", 8))
    hit, prompt = cached(two)
    # everything up to the answer's last full block: the prompt of turn 1 and most of its answer
    assert hit >= (turn1_prompt + 40 - 16) // 16 * 16 - 16, (hit, prompt)
    assert hit > turn1_prompt


async def test_64_streams_run_at_once_on_one_worker(backend: TorchBackend) -> None:
    widest: list[int] = []
    backend.scheduler.on_step = lambda _s, n: widest.append(n)
    try:
        requests = [session([f"Count to {i}."], [], f"c{i}", 6) for i in range(64)]
        streams = await asyncio.gather(*(run(backend, r) for r in requests))
    finally:
        backend.scheduler.on_step = None
    assert all(len(generated_token_ids(s)) == 6 for s in streams)
    assert max(widest) == 64  # every stream in one step: admitted together, none waited


async def test_a_small_pool_preempts_and_the_outputs_are_unchanged(
    backend: TorchBackend,
) -> None:
    def story(topic: str) -> GenerateRequest:
        request = session([f"Tell a story about {topic}."], [], topic, 48)
        return msgspec.structs.replace(request, messages=request.messages[1:])  # no system

    requests = [story(w) for w in ("ice", "fire", "sand")]  # two blocks of prompt each
    alone = [generated_token_ids(await run(backend, r)) for r in requests]
    tight = load(max_cached_tokens=16 * 10)  # 10 blocks: three prompts fit, three answers not
    await tight.start()
    try:
        together = await asyncio.gather(*(run(tight, r) for r in requests))
        assert tight.scheduler.preemptions >= 1
    finally:
        await tight.stop()
    assert [generated_token_ids(e) for e in together] == alone


async def test_a_long_prompt_is_spread_over_steps_that_carry_every_stream(
    backend: TorchBackend,
) -> None:
    steps: list[dict[str, int]] = []
    plan = backend.scheduler.planner.plan
    loop, decoding = asyncio.get_running_loop(), asyncio.Event()

    def recording() -> list[tuple[SequenceState, int]]:  # on the decode thread
        rows = plan()
        steps.append({s.job.request_id: n for s, n in rows})
        if len(rows) == 4 and all(n == 1 for _, n in rows):  # all four streams decoding
            loop.call_soon_threadsafe(decoding.set)
        return rows

    backend.scheduler.planner.plan = recording  # type: ignore[method-assign]
    try:
        streams = [
            asyncio.create_task(run(backend, session([f"Describe {w}."], [], w, 60)))
            for w in ("rain", "snow", "hail", "fog")
        ]
        await decoding.wait()
        long_text = " ".join(f"Paragraph {i} of a long log file." for i in range(150))
        long = await run(backend, session([long_text], [], "long", 2))
        await asyncio.gather(*streams)
    finally:
        del backend.scheduler.planner.plan
    budget = backend.scheduler.max_batched_tokens
    chunks = [i for i, s in enumerate(steps) if s.get("long", 0) > 1]
    assert sum(steps[i]["long"] for i in chunks) + cached(long)[0] == cached(long)[1]
    assert len(chunks) >= cached(long)[1] // budget
    assert all(sum(steps[i].values()) <= budget for i in chunks)
    # every step that read the prompt carried each stream still running then
    for w in ("rain", "snow", "hail", "fog"):
        mine = [i for i, s in enumerate(steps) if w in s]
        assert all(w in steps[i] for i in chunks if mine[0] <= i <= mine[-1])
    assert any(len(steps[i]) == 5 for i in chunks)  # it arrived while all four decoded
