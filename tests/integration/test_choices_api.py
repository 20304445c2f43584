"""``n`` > 1 end to end with the scripted worker: the official openai SDK -> real uvicorn -> Redis
-> the real worker, each choice a request of its own, merged into ``choices[i]``.

The scripted model answers every choice with the same text, so what is checked here is the
plumbing: n jobs and n logs, the merged stream's indexes, usage summed with the prompt counted
once, one answer streamed or not, cancellation of every choice, resume of the merged stream
after a composite ``Last-Event-ID``, the cap and queue admission. Seeds and the shared prefill
need a real model: ``test_choices_model.py``.
"""

from __future__ import annotations

import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from shared import keys
from shared.codec import decode_entries, decode_job
from shared.events import AnyEvent
from shared.jobs import choice_id
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

MODEL = "scripted-text"
REPLY = "Hello! This is a scripted reply from sluice's test double."
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def client(api: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0)


async def logs(redis: aioredis.Redis, rid: str, n: int) -> list[list[AnyEvent]]:
    out = []
    for i in range(n):
        events = decode_entries(await redis.xrange(keys.events(choice_id(rid, i))))
        check_stream(events)
        out.append(events)
    return out


async def test_chat_n3_not_streamed(api: str, worker: object, redis: aioredis.Redis) -> None:
    async with client(api) as c:
        done = await c.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=7)
        one = await c.chat.completions.create(model=MODEL, messages=ASK)
    assert [ch.index for ch in done.choices] == [0, 1, 2]
    assert all(ch.message.content == REPLY for ch in done.choices)
    assert all(ch.finish_reason == "stop" for ch in done.choices)
    assert done.usage is not None and one.usage is not None
    assert done.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt, once
    assert done.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    await logs(redis, done.id, 3)
    for i in range(3):
        job = decode_job(await redis.hget(keys.request(choice_id(done.id, i)), "job"))  # type: ignore[misc]
        assert (job.n, job.choice, job.sampling.seed) == (3, i, 7 + i)
        assert job.request_id == choice_id(done.id, i)


async def test_chat_n3_streamed_matches_the_fold(
    api: str, worker: object, redis: aioredis.Redis
) -> None:
    async with client(api) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=ASK,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        whole = await c.chat.completions.retrieve(chunks[0].id)
    texts = ["", "", ""]
    finishes: dict[int, str | None] = {}
    roles = [0, 0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert texts == [REPLY] * 3 and roles == [1, 1, 1]
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [ch.message.content for ch in whole.choices] == [REPLY] * 3


async def test_completions_n2(api: str, worker: object, redis: aioredis.Redis) -> None:
    async with client(api) as c:
        done = await c.completions.create(model=MODEL, prompt="hi", n=2, max_tokens=8, echo=True)
        stream = await c.completions.create(
            model=MODEL,
            prompt="hi",
            n=2,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert [(ch.index, ch.text) for ch in done.choices] == [(0, "hi" + REPLY[:8])] * 1 + [
        (1, "hi" + REPLY[:8])
    ]
    assert done.usage is not None and done.usage.completion_tokens == 16
    texts = ["", ""]
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [REPLY[:8]] * 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    await logs(redis, done.id, 2)


async def test_n_over_the_cap_and_best_of_are_400s(api: str, worker: object) -> None:
    async with client(api) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=ASK, n=9)
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model=MODEL, prompt="a", n=0)
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model=MODEL, prompt="a", n=2, best_of=3)
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "best_of"
        same = await c.completions.create(model=MODEL, prompt="a", n=2, best_of=2)
    assert len(same.choices) == 2
