"""A worker dies mid-answer; the client, streaming through the openai SDK, never notices.

Worker A is hard-killed (no terminal event, lease left to expire) after the client has read part
of the answer; worker B's sweeper re-enqueues a continuation that resumes after the tokens already
on the stream. The SDK's stream must read one continuous answer equal to an uninterrupted run.
"""

from __future__ import annotations

import openai
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.codec import decode_entries
from shared.events import Start
from tests.integration.worker_harness import FAST_FAILOVER, running_worker
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

MODEL = "m-failover"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}]}


async def read_all(stream: openai.AsyncStream) -> str:  # type: ignore[type-arg]
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_stream_survives_a_worker_death(
    api: str, redis_url: str, redis: aioredis.Redis
) -> None:
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        async with running_worker(redis_url, "scripted:long?rate=50", FAST_FAILOVER, MODEL) as a:
            stream = await client.chat.completions.create(**ASK, stream=True)  # type: ignore[call-overload]
            head = ""
            async for chunk in stream:
                if chunk.choices:
                    head += chunk.choices[0].delta.content or ""
                if len(head) > 20:
                    break
            rid = chunk.id
            await a.kill()
        async with running_worker(redis_url, "scripted:long?rate=0", FAST_FAILOVER, MODEL):
            tail = await read_all(stream)
            whole = await client.chat.completions.create(**ASK)  # type: ignore[call-overload]
    assert head + tail == whole.choices[0].message.content
    events = decode_entries(await redis.xrange(keys.events(rid)))
    check_stream(events)
    assert sum(isinstance(e, Start) for e in events) == 1
    assert await redis.hget(keys.request(rid), "attempts") == b"1"
