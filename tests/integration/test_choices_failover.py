"""A worker dies while it generates the choices of an ``n`` = 2 request; the client, streaming
through the openai SDK, gets both choices whole.

Each choice is a request of its own, so each fails over on its own: worker A is hard-killed
after the client has read part of both answers, worker B's sweeper continues each choice after
the tokens already on its log, and each choice reads as one answer equal to an uninterrupted
run, counted as one lost attempt each.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from shared import keys
from shared.codec import decode_entries
from shared.events import Start
from shared.jobs import choice_id
from tests.integration.worker_harness import FAST_FAILOVER, running_worker
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

MODEL = "m-choices-failover"
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a long story"}]


async def test_each_choice_survives_a_worker_death(
    api: str, redis_url: str, redis: aioredis.Redis
) -> None:
    texts = ["", ""]
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        async with running_worker(redis_url, "scripted:long?rate=50", FAST_FAILOVER, MODEL) as a:
            stream = await client.chat.completions.create(
                model=MODEL, messages=ASK, n=2, stream=True
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
                if min(map(len, texts)) > 20:
                    break
            rid = chunk.id
            await a.kill()
        async with running_worker(redis_url, "scripted:long?rate=0", FAST_FAILOVER, MODEL):
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
            whole = await client.chat.completions.create(model=MODEL, messages=ASK)
    assert texts == [whole.choices[0].message.content] * 2
    for i in range(2):
        events = decode_entries(await redis.xrange(keys.events(choice_id(rid, i))))
        check_stream(events)
        assert sum(isinstance(e, Start) for e in events) == 1
        assert await redis.hget(keys.request(choice_id(rid, i)), "attempts") == b"1"  # type: ignore[misc]


async def test_a_lost_choice_ends_the_answer_and_cancels_the_others(
    api: str, redis_url: str, redis: aioredis.Redis
) -> None:
    """No worker is left to continue: the tail of a silent choice ends the answer with a
    retryable worker_lost, and the request's other choices get their cancel flags."""
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        async with running_worker(redis_url, "scripted:long?rate=50", FAST_FAILOVER, MODEL) as a:
            stream = await client.chat.completions.create(
                model=MODEL, messages=ASK, n=2, stream=True
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].index == 1:
                    break
            rid = chunk.id
            await a.kill()
        with pytest.raises(openai.APIError, match="worker"):
            async for _ in stream:
                pass
    # The API raises the flags in the background as it ends the answer: wait for them.
    flags = [keys.cancel(choice_id(rid, i)) for i in range(2)]
    for _ in range(100):
        if await redis.exists(*flags) == 2:
            break
        await asyncio.sleep(0.05)
    assert await redis.exists(*flags) == 2
