"""The native API end to end on the API side: real uvicorn, real Redis, events XADDed as a
worker publishes them (the worker's own tests cover the producer; ``test_api_worker`` joins both).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from services.api.streaming import CANCEL_GRACE_S
from shared import keys
from shared.codec import decode_event, decode_job, encode_entry
from shared.events import AnyEvent, Error, Finish, Start, TextDelta, Usage
from shared.model_card import ModelCard
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

JOB = {
    "model": "tiny-test",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}],
}


def script(rid: str, n: int = 4) -> list[AnyEvent]:
    """A complete stream for ``rid``: Start, ``n`` text deltas, Usage, Finish."""
    deltas: list[AnyEvent] = [TextDelta(text=f" t{i}", token_ids=[10 + i]) for i in range(n)]
    return [
        Start(request_id=rid, model="tiny-test", prompt_tokens=3),
        *deltas,
        Usage(input_tokens=3, output_tokens=n),
        Finish(reason="end_turn"),
    ]


async def xadd(redis: aioredis.Redis, rid: str, event: AnyEvent) -> str:
    """Append one event exactly as the worker's publisher does; returns the entry id."""
    entry_id: bytes = await redis.xadd(keys.events(rid), encode_entry(event))  # type: ignore[arg-type]
    return entry_id.decode()


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, str]]:
    """Parse an SSE body into ``{event, id, data}`` dicts; comments come as ``{comment}``."""
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line.startswith(":"):
            yield {"comment": line[1:].strip()}
        elif not line:
            if fields:
                yield fields
            fields = {}
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            fields[name] = f"{fields[name]}\n{value}" if name in fields else value


async def create(client: httpx.AsyncClient, body: object = None) -> str:
    response = await client.post("/v1/requests", json=JOB if body is None else body)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


async def test_submit_stores_and_enqueues(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    async with httpx.AsyncClient(base_url=api) as client:
        rid = await create(client)
    stored = await redis.hgetall(keys.request(rid))  # type: ignore[misc]
    assert stored[b"model"] == b"tiny-test" and stored[b"origin"] == b"native"
    job = decode_job(stored[b"job"])
    assert job.request_id == rid and job.prompt_token_ids  # rendered and tokenized by the API
    assert job.prompt_text == "<|user|> hello world <|assistant|>"
    assert await redis.zrange(keys.queue("tiny-test"), 0, -1) == [rid.encode()]
    assert await redis.exists(f"arq:job:{rid}") == 1
    assert 0 < await redis.ttl(keys.request(rid)) <= 86_400


async def test_events_arrive_incrementally(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        events = script(rid)
        published: list[str] = []
        received: list[AnyEvent] = []
        async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-accel-buffering"] == "no"
            published.append(await xadd(redis, rid, events[0]))
            async for frame in sse_events(response):
                if "comment" in frame:
                    continue
                event = decode_event(msgspec.msgpack.encode(msgspec.json.decode(frame["data"])))
                assert frame["event"] == event.__struct_config__.tag
                assert frame["id"] == published[len(received)]
                received.append(event)
                # Lockstep: the next event is published only after this one reached the client,
                # so every event demonstrably arrived before the stream was complete.
                if len(received) < len(events):
                    published.append(await xadd(redis, rid, events[len(received)]))
    assert received == events
    check_stream(received)


async def test_keepalive_while_waiting(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
            frames = sse_events(response)
            assert await anext(frames) == {"comment": "keepalive"}
            for event in script(rid, 1):
                await xadd(redis, rid, event)
            got = [f async for f in frames if "comment" not in f]
    check_stream(
        [decode_event(msgspec.msgpack.encode(msgspec.json.decode(f["data"]))) for f in got]
    )


async def wait_for_key(redis: aioredis.Redis, key: str, tries: int = 200) -> bool:
    for _ in range(tries):
        if await redis.exists(key):
            return True
        await asyncio.sleep(0.025)
    return False


async def test_disconnect_sets_cancel_flag(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        events = script(rid)
        async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
            await xadd(redis, rid, events[0])
            frames = sse_events(response)
            first = await anext(f async for f in frames if "comment" not in f)
            assert first["event"] == "start"
            assert not await redis.exists(keys.cancel(rid))
        # leaving the block closed the connection mid-stream
    assert await wait_for_key(redis, keys.cancel(rid)), "cancel flag not set after disconnect"
    assert 0 < await redis.ttl(keys.cancel(rid)) <= 86_400


async def test_clients_gone_right_after_the_headers_are_cancelled(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    """Clients that hang up as soon as the headers arrive, before any event: every request is
    cancelled (before the hub's fix, one in 30 leaked its subscription under load, and a
    watched key skips the cancel)."""
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rids = [await create(client) for _ in range(30)]
    host, port = api.removeprefix("http://").split(":")

    async def hang_up(rid: str) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /v1/requests/{rid}/events HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")
        writer.close()
        await writer.wait_closed()

    await asyncio.gather(*(hang_up(r) for r in rids))
    # A hang guard, generous for a loaded CI box: each flag comes a second after its hang-up.
    missed = [r for r in rids if not await wait_for_key(redis, keys.cancel(r), 800)]
    assert missed == [], f"{len(missed)} of {len(rids)} not cancelled"


async def test_finished_stream_does_not_cancel(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        for event in script(rid):
            await xadd(redis, rid, event)
        response = await client.get(f"/v1/requests/{rid}/events")
    assert response.text.count("event: finish") == 1
    # A spurious cancel would land only after the disconnect grace: wait past it.
    await asyncio.sleep(CANCEL_GRACE_S + 0.5)
    assert not await redis.exists(keys.cancel(rid))


@pytest.mark.parametrize("how", ["header", "query"])
async def test_resume_after_last_event_id(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard, how: str
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        events = script(rid, 6)
        ids = [await xadd(redis, rid, e) for e in events]
        cut = 3
        if how == "header":
            response = await client.get(
                f"/v1/requests/{rid}/events", headers={"Last-Event-ID": ids[cut - 1]}
            )
        else:
            response = await client.get(
                f"/v1/requests/{rid}/events", params={"after": ids[cut - 1]}
            )
    assert response.status_code == 200
    frames = [f async for f in sse_events(response) if "comment" not in f]
    assert [f["id"] for f in frames] == ids[cut:]
    got = [decode_event(msgspec.msgpack.encode(msgspec.json.decode(f["data"]))) for f in frames]
    assert got == events[cut:]
    check_stream(events[:cut] + got)


@pytest.mark.parametrize("bad", ["x", "18446744073709551616-0", "1-18446744073709551616", "+1"])
async def test_resume_bad_id_is_400(api: str, tiny_model: ModelCard, bad: str) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        response = await client.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": bad})
        by_query = await client.get(f"/v1/requests/{rid}/events", params={"after": bad})
    for reply in (response, by_query):
        assert reply.status_code == 400
        assert reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"logprobs": True, "top_logprobs": 100_000}, "sampling.top_logprobs"),
        ({"top_logprobs": 5}, "sampling.top_logprobs"),
        ({"top_p": -1}, "sampling.top_p"),
        ({"min_p": 5}, "sampling.min_p"),
        ({"temperature": 1e9}, "sampling.temperature"),
        ({"top_k": -3}, "sampling.top_k"),
        ({"repetition_penalty": 0}, "sampling.repetition_penalty"),
        ({"presence_penalty": 3}, "sampling.presence_penalty"),
    ],
)
async def test_sampling_out_of_range_is_400(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard, sampling: dict[str, object], param: str
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        reply = await client.post("/v1/requests", json={**JOB, "sampling": sampling})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert await redis.zcard(keys.queue("tiny-test")) == 0


async def test_resume_after_the_terminal_entry_closes_at_once(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    """A client that got the last frame and reconnects is told the stream is over."""
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        ids = [await xadd(redis, rid, e) for e in script(rid, 2)]
        response = await client.get(f"/v1/requests/{rid}/events", params={"after": ids[-1]})
    assert response.status_code == 200
    assert [f async for f in sse_events(response) if "comment" not in f] == []


async def test_cancel_endpoint(api: str, redis: aioredis.Redis, tiny_model: ModelCard) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        response = await client.post(f"/v1/requests/{rid}/cancel")
        assert response.status_code == 200 and response.json() == {"id": rid, "cancelled": True}
        assert await redis.get(keys.cancel(rid)) == b"1"
        missing = await client.post("/v1/requests/req_nope/cancel")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


async def test_early_error_stream(api: str, redis: aioredis.Redis, tiny_model: ModelCard) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        await xadd(redis, rid, Error(kind="overloaded", message="nobody took it", retryable=True))
        response = await client.get(f"/v1/requests/{rid}/events")
    frames = [f async for f in sse_events(response) if "comment" not in f]
    assert [f["event"] for f in frames] == ["error"]
    check_stream([decode_event(msgspec.msgpack.encode(msgspec.json.decode(frames[0]["data"])))])


async def test_many_concurrent_streams_share_one_reader(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    n = 24
    async with httpx.AsyncClient(base_url=api, timeout=20) as client:
        rids = [await create(client) for _ in range(n)]
        db = redis.connection_pool.connection_kwargs.get("db", 0)

        async def read(rid: str) -> list[AnyEvent]:
            async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
                return [
                    decode_event(msgspec.msgpack.encode(msgspec.json.decode(f["data"])))
                    async for f in sse_events(response)
                    if "comment" not in f
                ]

        readers = [asyncio.create_task(read(rid)) for rid in rids]
        await asyncio.sleep(0.2)
        # one blocking connection serves every stream, not one per client (the server is
        # shared, so count only this database's clients)
        ours = [c for c in await redis.client_list() if int(c.get("db", -1)) == db]
        assert sum(c.get("name") == "sluice-hub" for c in ours) == 1
        assert len(ours) < n // 2
        for step in range(len(script(rids[0]))):
            async with redis.pipeline(transaction=False) as pipe:
                for rid in rids:
                    pipe.xadd(keys.events(rid), encode_entry(script(rid)[step]))  # type: ignore[arg-type]
                await pipe.execute()
        results = await asyncio.gather(*readers)
    for rid, got in zip(rids, results, strict=True):
        assert got == script(rid)
        check_stream(got)


async def test_undecodable_entry_ends_stream_in_band(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        await xadd(redis, rid, script(rid)[0])
        await redis.xadd(keys.events(rid), {b"v": b"1", b"e": b"\xc1garbage"})
        response = await client.get(f"/v1/requests/{rid}/events")
    assert response.status_code == 200  # headers were sent: the failure travels in-band
    frames = [f async for f in sse_events(response) if "comment" not in f]
    events = [decode_event(msgspec.msgpack.encode(msgspec.json.decode(f["data"]))) for f in frames]
    assert [f["event"] for f in frames] == ["start", "error"]
    assert isinstance(events[-1], Error) and events[-1].kind == "internal"
    check_stream(events)
    assert await wait_for_key(redis, keys.cancel(rid))  # nobody can read the rest: stop it


async def test_constraint_is_stored_with_the_job_and_a_bad_one_is_400(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    """The constraint travels in the stored job (replay and failover decode under it)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    constraint = {"kind": "json_schema", "json_schema": schema}
    async with httpx.AsyncClient(base_url=api) as client:
        rid = await create(client, {**JOB, "constraint": constraint})
        bad = {**JOB, "constraint": {"kind": "regex", "regex": "(unclosed"}}
        response = await client.post("/v1/requests", json=bad)
    job = decode_job(await redis.hget(keys.request(rid), "job"))  # type: ignore[misc]
    assert job.constraint is not None and job.constraint.json_schema == schema
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "constraint"
    assert await redis.zcard(keys.queue("tiny-test")) == 1  # only the good one was enqueued
