"""``store: false`` end to end: openai SDK and httpx -> real uvicorn -> Redis -> real worker.

A request sent with ``store: false`` keeps its event log and request hash only for the unstored
retention once its terminal event is out (the worker's terminal publish cuts both TTLs), its
retrieve routes answer 404 as OpenAI's do, and its event routes still resume it with
``Last-Event-ID`` inside that window. Requests that do not say ``store: false`` keep the full
retention and stay retrievable.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from services.api.start_timeout import claim_unstarted
from shared import keys
from shared.config import Settings
from shared.protocol import Claim
from tests.integration.worker_harness import WorkerHandle, running_worker
from tests.sse_frames import data_frames

pytestmark = pytest.mark.integration

MODEL = "scripted-text"
WINDOW_S = 30  # the workers' unstored retention here: far below the 86,400 s default retention
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
LONG = {"lease_ttl_s": 10.0, "heartbeat_s": 0.5}  # a busy CI box never "loses" the lease


@pytest.fixture
async def window_worker(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[WorkerHandle]:
    async with running_worker(
        redis_url, "scripted:text?rate=0", {**LONG, "unstored_retention_s": WINDOW_S}
    ) as handle:
        yield handle


def chat(**extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "metadata": {"script": "text"},
        **extra,
    }


def content(frames: list[tuple[str | None, str]]) -> str:
    """The answer text the chunks carry, however it is split between them."""
    chunks = [json.loads(d) for _, d in frames if d != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def ttls(redis: aioredis.Redis, rid: str) -> tuple[int, int]:
    return await redis.ttl(keys.events(rid)), await redis.ttl(keys.request(rid))


async def test_unstored_chat_keeps_only_the_window_and_resumes_in_it(
    api: str, window_worker: WorkerHandle, redis: aioredis.Redis
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        first = data_frames(
            (await http.post("/v1/chat/completions", json=chat(stream=True, store=False))).text
        )
        rid = json.loads(first[0][1])["id"]
        # The stream has ended (the client saw [DONE]): both keys now expire within the window.
        events_ttl, request_ttl = await ttls(redis, rid)
        assert 0 < events_ttl <= WINDOW_S and 0 < request_ttl <= WINDOW_S
        assert await redis.hget(keys.request(rid), "store") == b"0"
        retrieved = await http.get(f"/v1/chat/completions/{rid}")
        cut = 2
        resumed = await http.get(
            f"/v1/chat/completions/{rid}/events", headers={"Last-Event-ID": first[cut - 1][0]}
        )
    assert retrieved.status_code == 404
    assert retrieved.json()["error"]["message"] == f"no request with id '{rid}'"
    assert resumed.status_code == 200, resumed.text
    # A finished log resumes as one backlog, its deltas folded into fewer chunks: the text is
    # the same, nothing lost or repeated (frame boundaries are not: docs/capacity.md).
    assert content(first[:cut] + data_frames(resumed.text)) == content(first)
    assert data_frames(resumed.text)[-1][1] == "[DONE]"
    assert first[-1][1] == "[DONE]"


async def test_chat_without_store_false_is_kept_and_retrievable(
    api: str, window_worker: WorkerHandle, redis: aioredis.Redis
) -> None:
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        done = await client.chat.completions.create(**chat())  # type: ignore[call-overload]
        again = await client.chat.completions.retrieve(done.id)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.retrieve(
                (await client.chat.completions.create(**chat(store=False))).id  # type: ignore[call-overload]
            )
    assert again.model_dump() == done.model_dump()
    events_ttl, request_ttl = await ttls(redis, done.id)
    assert events_ttl > WINDOW_S and request_ttl > WINDOW_S


async def test_unstored_response_is_404_and_resumable_on_the_native_route(
    api: str, window_worker: WorkerHandle, redis: aioredis.Redis
) -> None:
    body = {"input": "hi", "metadata": {"script": "text"}, "store": False}
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        done = await client.responses.create(model=MODEL, **body)  # type: ignore[call-overload]
        assert done.status == "completed" and done.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(done.id)
    events_ttl, request_ttl = await ttls(redis, done.id)
    assert 0 < events_ttl <= WINDOW_S and 0 < request_ttl <= WINDOW_S
    assert await redis.exists(keys.response(done.id)) == 0
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        replay = data_frames((await http.get(f"/v1/requests/{done.id}/events")).text)
        resumed = data_frames(
            (
                await http.get(
                    f"/v1/requests/{done.id}/events", headers={"Last-Event-ID": replay[0][0]}
                )
            ).text
        )
    assert [d for _, d in resumed] == [d for _, d in replay[1:]]
    assert json.loads(replay[-1][1])["type"] == "finish"


async def test_nothing_is_readable_once_the_window_has_passed(
    api: str, redis_url: str, redis: aioredis.Redis
) -> None:
    fast = {**LONG, "unstored_retention_s": 1}
    async with (
        # Slow enough (2 tokens/s) that the events GET starts before the 1 s window can end.
        running_worker(redis_url, "scripted:text?rate=2", fast),
        httpx.AsyncClient(base_url=api, timeout=30) as http,
    ):
        created = await http.post(
            "/v1/requests",
            json={"model": MODEL, "messages": MESSAGES, "store": False, "max_tokens": 6},
        )
        rid = created.json()["id"]
        ended = data_frames((await http.get(f"/v1/requests/{rid}/events")).text)
        assert json.loads(ended[-1][1])["type"] == "finish"
        # Redis expires the keys on its own clock; wait for it rather than racing it.
        deadline = asyncio.get_running_loop().time() + 30
        while await redis.exists(keys.events(rid), keys.request(rid)):
            assert asyncio.get_running_loop().time() < deadline, await ttls(redis, rid)
            await asyncio.sleep(0.1)
        gone = await http.get(f"/v1/requests/{rid}/events")
    assert gone.status_code == 404


@pytest.mark.parametrize(("store", "short"), [(b"0", True), (b"1", False)])
async def test_the_start_timeout_of_an_unstored_request_keeps_only_the_window(
    redis: aioredis.Redis, redis_url: str, store: bytes, short: bool
) -> None:
    settings = Settings(redis_url=redis_url, unstored_retention_s=WINDOW_S)
    rid = "req_unstored_timeout"
    await redis.hset(keys.request(rid), mapping={"model": MODEL, "store": store})
    await redis.expire(keys.request(rid), settings.retention_s)
    assert await claim_unstarted(redis, rid, settings) == Claim.TIMED_OUT
    events_ttl, request_ttl = await ttls(redis, rid)
    if short:
        assert 0 < events_ttl <= WINDOW_S and 0 < request_ttl <= WINDOW_S
    else:
        assert events_ttl > WINDOW_S and request_ttl > WINDOW_S
