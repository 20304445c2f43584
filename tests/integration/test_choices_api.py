"""``n`` > 1 end to end with the scripted worker: the official openai SDK -> real uvicorn -> Redis
-> the real worker, each choice a request of its own, merged into ``choices[i]``.

The scripted model answers every choice with the same text, so what is checked here is the
plumbing: n jobs and n logs, the merged stream's indexes, usage summed with the prompt counted
once, one answer streamed or not, cancellation of every choice, resume of the merged stream
after a composite ``Last-Event-ID``, the cap and queue admission. Seeds and the shared prefill
need a real model: ``test_choices_model.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from shared import keys
from shared.codec import decode_entries, decode_job
from shared.config import Settings
from shared.events import Finish, Start
from shared.jobs import choice_id
from tests.integration.server_harness import running_api
from tests.integration.worker_harness import running_worker
from tests.sse_frames import choice_logs, choice_texts, data_frames

pytestmark = pytest.mark.integration

MODEL = "scripted-text"
REPLY = "Hello! This is a scripted reply from sluice's test double."
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def client(api: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0)


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
    await choice_logs(redis, done.id, 3)
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
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        # replayed in the formats that can show it: Chat's chunks merge both choices, a format
        # without choices (Messages) shows the request's own id, choice 0
        as_chat = await http.get(f"/v1/chat/completions/{done.id}/events")
        as_messages = await http.get(f"/v1/messages/{done.id}")
    assert [(ch.index, ch.text) for ch in done.choices] == [(0, "hi" + REPLY[:8])] * 1 + [
        (1, "hi" + REPLY[:8])
    ]
    assert choice_texts(data_frames(as_chat.text), 2) == [REPLY[:8]] * 2
    assert as_messages.json()["content"][0]["text"] == REPLY[:8]
    assert done.usage is not None and done.usage.completion_tokens == 16
    texts = ["", ""]
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [REPLY[:8]] * 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    await choice_logs(redis, done.id, 2)


async def test_completions_prompt_batch(api: str, worker: object, redis: aioredis.Redis) -> None:
    """A batch of prompts through the SDK: choice index = prompt * n + j, each choice answers
    (and echoes) its own prompt, usage counts every prompt once; streamed alike."""
    prompts = ["hi", "a longer second prompt"]
    async with client(api) as c:
        one = await c.completions.create(model=MODEL, prompt=prompts[1], max_tokens=8)
        done = await c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, echo=True)
        stream = await c.completions.create(
            model=MODEL,
            prompt=prompts,
            n=2,
            max_tokens=8,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    want = [p + REPLY[:8] for p in prompts for _ in range(2)]
    assert [(ch.index, ch.text) for ch in done.choices] == list(enumerate(want))
    assert done.usage is not None and one.usage is not None
    assert done.usage.completion_tokens == 4 * 8
    assert done.usage.prompt_tokens == len(await _prompt_ids(redis, done.id, 0)) + (
        one.usage.prompt_tokens
    )
    texts = ["", "", "", ""]
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == want
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens
    )
    jobs = [
        decode_job(await redis.hget(keys.request(choice_id(done.id, i)), "job")) for i in range(4)
    ]  # type: ignore[misc]
    assert [j.prompt_text for j in jobs] == [p for p in prompts for _ in range(2)]
    await choice_logs(redis, done.id, 4)


async def _prompt_ids(redis: aioredis.Redis, rid: str, choice: int) -> list[int]:
    raw = await redis.hget(keys.request(choice_id(rid, choice)), "job")  # type: ignore[misc]
    return list(decode_job(raw).prompt_token_ids)


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


LONG = "m-choices-long"


async def test_resume_mid_stream_continues_every_choice_exactly(
    api: str, redis_url: str, redis: aioredis.Redis
) -> None:
    overrides = {"lease_ttl_s": 10.0, "heartbeat_s": 0.5}
    body = {"model": LONG, "messages": ASK, "n": 3, "stream": True}
    async with (
        running_worker(redis_url, "scripted:long?rate=1000", overrides, LONG),
        httpx.AsyncClient(base_url=api, timeout=30) as http,
    ):
        head: list[tuple[str | None, str]] = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            buffer = ""
            async for text in reply.aiter_text():
                buffer += text
                *blocks, buffer = buffer.split("\n\n")
                head += data_frames("\n\n".join(blocks) + "\n\n")
                if sum(1 for i, _ in head if i) >= 12:
                    break
        cut = max(k for k, (i, _) in enumerate(head) if i) + 1  # the client has up to this id
        head, last_id = head[:cut], head[cut - 1][0]
        assert last_id is not None and len(last_id.split(",")) == 3
        rid = json.loads(head[0][1])["id"]
        resumed = await http.get(
            f"/v1/chat/completions/{rid}/events", headers={"Last-Event-ID": last_id}
        )
        rest = data_frames(resumed.text)
        replay = await http.get(f"/v1/chat/completions/{rid}/events")
        again = await http.get(f"/v1/chat/completions/{rid}/events")
        wrong = await http.get(  # one entry id is not a position in three logs
            f"/v1/chat/completions/{rid}/events", headers={"Last-Event-ID": "1-0"}
        )
        done = await http.get(f"/v1/chat/completions/{rid}")
        final_id = [i for i, _ in data_frames(replay.text) if i][-1]
        after_end = await http.get(
            f"/v1/chat/completions/{rid}/events", headers={"Last-Event-ID": final_id}
        )
    assert after_end.text == "data: [DONE]\n\n"  # resumed after every choice's end
    assert resumed.status_code == 200 and rest[-1] == (None, "[DONE]")
    whole = [c["message"]["content"] for c in done.json()["choices"]]
    assert choice_texts(head + rest, 3) == whole  # nothing lost, nothing repeated, per choice
    assert choice_texts(data_frames(replay.text), 3) == whole
    assert replay.content == again.content  # a finished request replays the same bytes
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "after"
    before = [tuple(map(int, p.split("-"))) for p in last_id.split(",")]
    for frame_id, _ in rest:  # every later position is at or past where the client was
        if frame_id is not None:
            now = [tuple(map(int, p.split("-"))) for p in frame_id.split(",")]
            assert all(a >= b for a, b in zip(now, before, strict=True))
    for events in await choice_logs(redis, rid, 3):
        assert sum(isinstance(e, Start) for e in events) == 1


async def test_disconnect_and_cancel_end_every_choice(
    api: str, redis_url: str, redis: aioredis.Redis
) -> None:
    async with (
        running_worker(redis_url, "scripted:long?rate=100", None, LONG),
        client(api) as c,
        httpx.AsyncClient(base_url=api, timeout=30) as http,
    ):
        stream = await c.chat.completions.create(model=LONG, messages=ASK, n=3, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].index == 2:
                break
        gone = chunk.id
        await stream.close()  # the client leaves: all three are cancelled after the grace
        body = {"model": LONG, "messages": ASK, "n": 2, "stream": True}
        kept = ""
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            lines = reply.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    kept = json.loads(line[6:])["id"]
                    break
            cancelled = await http.post(f"/v1/requests/{kept}/cancel")
            assert cancelled.status_code == 200
            tail = [line async for line in lines if line.startswith("data: ")]
        assert tail[-1] == "data: [DONE]"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ends = [
                await redis.xrevrange(keys.events(choice_id(gone, i)), count=1) for i in range(3)
            ]
            if all(e and isinstance(decode_entries(e)[-1], Finish) for e in ends):
                break
            await asyncio.sleep(0.1)
    for rid, n in ((gone, 3), (kept, 2)):
        for events in await choice_logs(redis, rid, n):
            assert events[-1] == Finish(reason="cancelled"), (rid, events[-1])


async def test_one_request_queues_all_its_choices_or_none(
    settings: Settings, redis: aioredis.Redis, tiny_model: object
) -> None:
    # No worker takes jobs here (a heartbeat only), so the queue fills up: with SLUICE_QUEUE_MAX
    # 4, n=3 fits, then a second n=3 does not: nothing of it is queued or stored.
    async with (
        running_api(msgspec.structs.replace(settings, queue_max=4)) as base,
        client(base) as c,
    ):
        body = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}
        first = await c.chat.completions.with_raw_response.create(  # type: ignore[call-overload]
            **body, n=3, stream=True
        )
        rid = first.headers["x-request-id"]
        with pytest.raises(openai.RateLimitError):
            await c.chat.completions.create(**body, n=3)  # type: ignore[call-overload]
        await first.parse().close()
    queued = {m.decode() for m in await redis.zrange(keys.queue("tiny-test"), 0, -1)}
    assert queued == {rid, f"{rid}.1", f"{rid}.2"}
    assert len([k async for k in redis.scan_iter(match=keys.request("*"))]) == 3


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def test_tool_calls_per_choice_and_a_failing_request(
    api: str, worker: object, redis: aioredis.Redis
) -> None:
    body = {"model": MODEL, "messages": ASK, "n": 2, "tools": TOOLS}
    async with client(api) as c:
        done = await c.chat.completions.create(**body, metadata={"script": "parallel_tool_calls"})  # type: ignore[call-overload]
        stream = await c.chat.completions.create(  # type: ignore[call-overload]
            **body, metadata={"script": "parallel_tool_calls"}, stream=True
        )
        calls: dict[int, dict[int, str]] = {0: {}, 1: {}}
        async for chunk in stream:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    args = calls[choice.index].get(call.index, "")
                    calls[choice.index][call.index] = args + (call.function.arguments or "")
        with pytest.raises(openai.InternalServerError, match="scripted failure"):
            await c.chat.completions.create(**body, metadata={"script": "error"})  # type: ignore[call-overload]
        failing = await c.chat.completions.create(  # type: ignore[call-overload]
            **body, metadata={"script": "error"}, stream=True
        )
        with pytest.raises(openai.APIError, match="scripted failure"):
            async for _ in failing:
                pass
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls"
        got = [c.function.arguments for c in choice.message.tool_calls or []]
        assert len(got) == 2 and got == list(calls[choice.index].values())
    await choice_logs(redis, done.id, 2)


async def test_every_choice_is_its_creator_s_only(
    settings: Settings, worker: object, redis: aioredis.Redis
) -> None:
    keyed = msgspec.structs.replace(settings, api_keys=["key-a", "key-b"])
    body = {"model": MODEL, "messages": ASK, "n": 2}
    a, b = {"x-api-key": "key-a"}, {"x-api-key": "key-b"}
    async with running_api(keyed) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        made = await http.post("/v1/chat/completions", json=body, headers=a)
        rid = made.json()["id"]
        routes = [
            ("GET", f"/v1/chat/completions/{rid}"),
            ("GET", f"/v1/chat/completions/{rid}.1"),
            ("GET", f"/v1/chat/completions/{rid}/events"),
            ("GET", f"/v1/chat/completions/{rid}.1/events"),
            ("POST", f"/v1/requests/{rid}/cancel"),
            ("POST", f"/v1/requests/{rid}.1/cancel"),
        ]
        others = [(await http.request(m, url, headers=b)).status_code for m, url in routes]
        owns = [(await http.request(m, url, headers=a)).status_code for m, url in routes[:4]]
        # A key that owns choice 0 but not choice 1 (say, a record rewritten) reads nothing.
        await redis.hset(keys.request(f"{rid}.1"), "owner", "someone-else")  # type: ignore[misc]
        partial = await http.get(f"/v1/chat/completions/{rid}", headers=a)
    assert made.status_code == 200 and len(made.json()["choices"]) == 2
    assert others == [404] * 6 and owns == [200] * 4
    assert partial.status_code == 404
