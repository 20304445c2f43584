"""Ollama's API end to end: the official ``ollama`` client -> real uvicorn -> Redis -> workers.

Scripted workers serve one scenario each, the model name picking it (``scripted-text``,
``scripted-reasoning``, ``scripted-tool_call``, ``scripted-error``). Every answer is checked
against ``render(fold(events))`` of the events actually on the request's Redis stream, streamed
lines against the non-streaming body, and the stored job against what the request asked for.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import msgspec
import ollama
import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from shared import keys
from shared.codec import decode_entries, decode_job
from shared.jobs import Job
from tests.integration.worker_harness import running_worker
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

TEXT = "Hello! This is a scripted reply from sluice's test double."
CALM = {"heartbeat_s": 1.0, "lease_ttl_s": 5.0}
SCENARIOS = ("text", "reasoning", "tool_call", "error")
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def workers(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[None]:
    """One scripted worker per scenario (no token delay), each its own model."""
    async with contextlib.AsyncExitStack() as stack:
        for scenario in SCENARIOS:
            await stack.enter_async_context(
                running_worker(redis_url, f"scripted:{scenario}?rate=0", CALM)
            )
        yield


@pytest.fixture
async def client(api: str, workers: None) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=api)


@pytest.fixture
async def http(api: str, workers: None) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api, timeout=30) as c:
        yield c


async def stored(redis: aioredis.Redis, rid: str) -> Job:
    return decode_job(await redis.hget(keys.request(rid), "job"))


async def events_of(redis: aioredis.Redis, rid: str) -> list[object]:
    events = decode_entries(await redis.xrange(keys.events(rid)))
    check_stream(events)
    return events


async def test_chat_not_streamed_and_streamed(client: ollama.AsyncClient) -> None:
    whole = await client.chat(model="scripted-text", messages=USER, stream=False)
    assert whole.message.content == TEXT and whole.done and whole.done_reason == "stop"
    assert whole.model == "scripted-text" and whole.created_at
    assert whole.prompt_eval_count and whole.eval_count and whole.total_duration is not None
    parts = [p async for p in await client.chat(model="scripted-text", messages=USER, stream=True)]
    assert "".join(p.message.content or "" for p in parts) == TEXT
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == "stop"


async def test_generate_not_streamed_and_streamed(client: ollama.AsyncClient) -> None:
    whole = await client.generate(model="scripted-text", prompt="hello", system="be terse")
    assert whole.response == TEXT and whole.done and whole.done_reason == "stop"
    parts = [
        p async for p in await client.generate(model="scripted-text", prompt="hi", stream=True)
    ]
    assert "".join(p.response or "" for p in parts) == TEXT and parts[-1].done


async def test_stream_is_ndjson_by_default_and_equals_the_fold(
    http: httpx.AsyncClient, redis: aioredis.Redis
) -> None:
    body = {"model": "scripted-reasoning", "messages": USER, "think": True}
    async with http.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        rid = r.headers["x-request-id"]
        lines = [json.loads(line) async for line in r.aiter_lines()]
    assert all(line["model"] == "scripted-reasoning" for line in lines)
    thinking = "".join(line["message"].get("thinking", "") for line in lines)
    content = "".join(line["message"]["content"] for line in lines)
    retrieved = (await http.get(f"/api/chat/{rid}")).json()
    assert retrieved["message"]["thinking"] == thinking and thinking
    assert retrieved["message"]["content"] == content == "Hi there! How can I help?"
    assert retrieved["eval_count"] == lines[-1]["eval_count"]
    assert (await stored(redis, rid)).reasoning.explicit
    await events_of(redis, rid)


async def test_think_false_hides_and_disables_thinking(
    http: httpx.AsyncClient, redis: aioredis.Redis
) -> None:
    body = {"model": "scripted-reasoning", "messages": USER, "think": False, "stream": False}
    r = await http.post("/api/chat", json=body)
    assert "thinking" not in r.json()["message"]
    assert (await stored(redis, r.headers["x-request-id"])).reasoning.effort == "none"


def get_weather(city: str) -> str:
    """Get the current weather.

    Args:
        city: the city

    Returns:
        The weather.
    """
    return "sunny"


@pytest.mark.parametrize("stream", [False, True])
async def test_tools(client: ollama.AsyncClient, stream: bool) -> None:
    if stream:
        parts = [
            p
            async for p in await client.chat(
                model="scripted-tool_call", messages=USER, tools=[get_weather], stream=True
            )
        ]
        calls = [c for p in parts for c in p.message.tool_calls or []]
    else:
        reply = await client.chat(model="scripted-tool_call", messages=USER, tools=[get_weather])
        calls = list(reply.message.tool_calls or [])
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # The call goes back in the history with its result, as Ollama's tool loop does.
    history = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    follow = await client.chat(model="scripted-text", messages=history, tools=[get_weather])
    assert follow.message.content == TEXT


class Weather(BaseModel):
    city: str
    celsius: int


async def test_format_with_a_pydantic_schema(
    client: ollama.AsyncClient, redis: aioredis.Redis
) -> None:
    schema = Weather.model_json_schema()
    await client.chat(model="scripted-text", messages=USER, format=schema)
    await client.generate(model="scripted-text", prompt="x", format="json")
    jobs = [decode_job(await redis.hget(k, "job")) async for k in redis.scan_iter("sluice:req*")]
    kinds = sorted((j.constraint.kind, j.origin) for j in jobs if j.constraint)
    assert kinds == [("json_object", "ollama"), ("json_schema", "ollama")]
    (schema_job,) = [j for j in jobs if j.constraint and j.constraint.kind == "json_schema"]
    assert schema_job.constraint and schema_job.constraint.json_schema == schema


async def test_options_and_num_ctx(http: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    options = {"temperature": 0.2, "top_k": 20, "seed": 3, "num_predict": 8, "num_ctx": 10**6}
    body = {"model": "scripted-text", "prompt": "hi", "stream": False, "options": options}
    r = await http.post("/api/generate", json={**body, "keep_alive": "10m"})
    assert r.status_code == 200
    job = await stored(redis, r.headers["x-request-id"])
    assert (job.sampling.temperature, job.sampling.top_k, job.sampling.seed) == (0.2, 20, 3)
    assert job.max_tokens == 8  # a num_ctx past the model's own is the model's context
    small = {**options, "num_predict": -1, "num_ctx": len(job.prompt_token_ids) + 5}
    r = await http.post("/api/generate", json={**body, "options": small})
    assert (await stored(redis, r.headers["x-request-id"])).max_tokens == 5
    r = await http.post("/api/generate", json={**body, "options": {"num_ctx": 2}})
    assert r.status_code == 400 and "num_ctx" in r.json()["error"]


async def test_model_endpoints(client: ollama.AsyncClient, http: httpx.AsyncClient) -> None:
    names = sorted(m.model or "" for m in (await client.list()).models)
    assert names == sorted(f"scripted-{s}" for s in SCENARIOS)
    shown = await client.show("scripted-reasoning")
    assert shown.capabilities and "thinking" in shown.capabilities
    assert shown.modelinfo and shown.modelinfo["scripted.context_length"] > 0
    running = await client.ps()
    assert {m.model for m in running.models} == set(names)
    assert (await http.get("/api/version")).json() == {"version": "0.12.0"}
    with pytest.raises(ollama.ResponseError) as err:
        await client.show("nope")
    assert err.value.status_code == 404


async def test_load_without_a_prompt(client: ollama.AsyncClient) -> None:
    loaded = await client.generate(model="scripted-text")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    with pytest.raises(ollama.ResponseError) as err:
        await client.generate(model="nope")
    assert err.value.status_code == 404


async def test_errors_in_ollamas_shape(client: ollama.AsyncClient, http: httpx.AsyncClient) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        await client.chat(model="nope", messages=USER)
    assert err.value.status_code == 404
    for body in (b"{", b'{"model": "scripted-text", "options": {"temperature": "hot"}}'):
        r = await http.post("/api/chat", content=body)
        assert r.status_code == 400 and set(r.json()) == {"error"}
    r = await http.post(
        "/api/generate", json={"model": "scripted-text", "prompt": "x", "raw": True}
    )
    assert r.status_code == 400 and "raw" in r.json()["error"]
    # A failure after the headers is an in-band error line, which the client raises.
    with pytest.raises(ollama.ResponseError, match="scripted failure"):
        async for _ in await client.chat(model="scripted-error", messages=USER, stream=True):
            pass
    with pytest.raises(ollama.ResponseError) as failed:
        await client.chat(model="scripted-error", messages=USER)
    assert failed.value.status_code == 500


async def test_replay_and_resume(http: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    body = {"model": "scripted-text", "prompt": "hi"}
    async with http.stream("POST", "/api/generate", json=body) as r:
        rid = r.headers["x-request-id"]
        lines = [line async for line in r.aiter_lines()]
    replay = await http.get(f"/api/generate/{rid}/events")
    assert replay.text.splitlines() == lines
    resumed = await http.get(f"/api/generate/{rid}/events", params={"lines": 2})
    assert resumed.text.splitlines() == lines[2:]
    whole = (await http.get(f"/api/generate/{rid}")).json()
    assert whole["response"] == "".join(json.loads(line)["response"] for line in lines)
    # Any stored request re-projects, whatever format created it: here as a chat message.
    assert (await http.get(f"/api/chat/{rid}")).json()["message"]["content"] == TEXT
    assert (await http.get("/api/chat/ollama_nope")).status_code == 404
    assert msgspec.json.decode(replay.content.splitlines()[-1])["done"] is True
    await events_of(redis, rid)
