"""The API-side start timeout: a request no worker starts ends with Error(overloaded), once.

Real Redis, a real uvicorn server and the real worker job function (scripted backend): the claim
must stay atomic with the worker's lease, so a worker arriving at the deadline either generates
the whole answer or nothing, never a second terminal event or a Start after the Error.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from services.api.start_timeout import claim_unstarted, start_deadline, sweep_unstarted
from services.worker.job_function import WorkerContext, run_job
from services.worker.scripted import parse_spec
from shared import keys
from shared.codec import decode_entries, decode_job, encode_job
from shared.config import Settings
from shared.events import AnyEvent, Error, Finish, Start
from shared.jobs import Job
from shared.model_card import ModelCard
from shared.protocol import API_TIMEOUT_OWNER, Claim
from tests.integration.test_api_native import JOB, create, sse_events
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

_EVENT = msgspec.json.Decoder(AnyEvent)


@pytest.fixture
def settings(redis_url: str) -> Settings:
    """A short start timeout (the default is ten minutes)."""
    return Settings(
        redis_url=redis_url, keepalive_s=0.5, heartbeat_s=0.2, lease_ttl_s=3.0, start_timeout_s=0.6
    )


@pytest.fixture
async def worker_redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A second connection for the worker: its commands interleave with the API's on the server."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def worker_context(settings: Settings, redis: aioredis.Redis, wid: str) -> WorkerContext:
    backend = parse_spec("scripted:text?rate=0", "tiny-test")
    return WorkerContext(settings=settings, redis=redis, backend=backend, name="tiny-test", wid=wid)


async def stored(redis: aioredis.Redis, rid: str) -> list[AnyEvent]:
    return decode_entries(await redis.xrange(keys.events(rid)))


def is_timeout(events: list[AnyEvent]) -> bool:
    return (
        len(events) == 1
        and isinstance(events[0], Error)
        and events[0].kind == "overloaded"
        and events[0].retryable
    )


async def test_no_worker_ends_the_stream_with_overloaded(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard, settings: Settings
) -> None:
    received: list[AnyEvent] = []
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
        assert await redis.zrange(keys.queue("tiny-test"), 0, -1) == [rid.encode()]
        async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
            async for frame in sse_events(response):
                if "comment" not in frame:
                    received.append(_EVENT.decode(frame["data"]))
    check_stream(received)
    assert is_timeout(received), received
    # the job left the queue and the in-flight set; the lease fences any worker that has it
    assert await redis.zcard(keys.queue("tiny-test")) == 0
    assert await redis.exists(f"arq:job:{rid}") == 0
    assert await redis.zscore(keys.inflight("tiny-test"), rid) is None
    assert await redis.get(keys.lease(rid)) == API_TIMEOUT_OWNER.encode()

    # A worker that had already dequeued the job runs it now: it must publish nothing.
    job = decode_job(await redis.hget(keys.request(rid), "job"))  # type: ignore[misc]
    await run_job(worker_context(settings, redis, "w-late"), job)
    assert await stored(redis, rid) == received
    # and a second watcher (a reconnect from the start) sees the same single Error at once
    async with (
        httpx.AsyncClient(base_url=api, timeout=10) as client,
        client.stream("GET", f"/v1/requests/{rid}/events") as response,
    ):
        again = [_EVENT.decode(f["data"]) async for f in sse_events(response) if "data" in f]
    assert again == received


async def test_a_started_request_is_never_timed_out(
    redis: aioredis.Redis, worker_redis: aioredis.Redis, settings: Settings
) -> None:
    job = await store_job(redis, "req_started")
    await run_job(worker_context(settings, worker_redis, "w-first"), job)
    assert await claim_unstarted(redis, job.request_id, settings) == Claim.STARTED
    events = await stored(redis, job.request_id)
    check_stream(events)
    assert isinstance(events[0], Start) and isinstance(events[-1], Finish)


async def test_a_leased_request_is_left_to_its_worker(
    redis: aioredis.Redis, settings: Settings
) -> None:
    job = await store_job(redis, "req_leased")
    # a worker took the lease but has not published its Start yet
    await redis.set(keys.lease(job.request_id), "w-slow", px=3_000)
    assert await claim_unstarted(redis, job.request_id, settings) == Claim.HELD
    assert await redis.xlen(keys.events(job.request_id)) == 0


async def store_job(
    redis: aioredis.Redis, rid: str, *, age_s: float = 0.0, start_by: float | None = None
) -> Job:
    job = Job(
        request_id=rid,
        model="tiny-test",
        created=time.time() - age_s,
        prompt_token_ids=[1, 2, 3],
        prompt_text="",
    )
    await redis.hset(  # type: ignore[misc]
        keys.request(rid),
        mapping={
            "owner": "",
            "model": "tiny-test",
            "created": repr(job.created),
            "job": encode_job(job),
            **({} if start_by is None else {"start_by": repr(start_by)}),
        },
    )
    return job


async def test_a_worker_starting_at_the_deadline_never_races_the_timeout(
    redis: aioredis.Redis, worker_redis: aioredis.Redis, settings: Settings
) -> None:
    """The claim and the worker's job start at nearly the same moment, on separate connections,
    in both orders; every stream must be exactly one of the two complete outcomes."""
    rng = random.Random(7)
    outcomes: dict[int, int] = {}

    async def one(i: int) -> None:
        job = await store_job(redis, f"req_race_{i}")
        wc = worker_context(settings, worker_redis, f"w-race-{i}")

        async def claim() -> int:
            await asyncio.sleep(rng.random() * 0.004)
            return await claim_unstarted(redis, job.request_id, settings)

        async def work() -> None:
            await asyncio.sleep(rng.random() * 0.004)
            await run_job(wc, job)

        result, _ = await asyncio.gather(claim(), work())
        events = await stored(redis, job.request_id)
        check_stream(events)
        if result == Claim.TIMED_OUT:
            assert is_timeout(events), events
        else:
            assert isinstance(events[0], Start) and isinstance(events[-1], Finish), events
        outcomes[result] = outcomes.get(result, 0) + 1

    await asyncio.gather(*(one(i) for i in range(40)))
    assert sum(outcomes.values()) == 40, outcomes


async def test_worker_arriving_around_the_deadline_end_to_end(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard, settings: Settings
) -> None:
    """A real client waits while a worker runs the job just around the start deadline."""
    received: list[AnyEvent] = []
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client, JOB)
        job = decode_job(await redis.hget(keys.request(rid), "job"))  # type: ignore[misc]

        async def late_worker() -> None:
            await asyncio.sleep(settings.start_timeout_s - 0.02)
            async with aioredis.Redis.from_url(settings.redis_url) as conn:
                await run_job(worker_context(settings, conn, "w-edge"), job)

        worker = asyncio.create_task(late_worker())
        async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
            async for frame in sse_events(response):
                if "comment" not in frame:
                    received.append(_EVENT.decode(frame["data"]))
        await worker
    check_stream(received)
    assert received == await stored(redis, rid)
    assert is_timeout(received) or isinstance(received[0], Start)


async def test_sweep_times_out_unwatched_requests_only(
    redis: aioredis.Redis, worker_redis: aioredis.Redis, settings: Settings
) -> None:
    old = (time.time() - 60) * 1000
    await redis.sadd(keys.models(), "tiny-test")  # type: ignore[misc]
    waiting = await store_job(redis, "req_waiting", age_s=60)
    started = await store_job(redis, "req_running", age_s=60)
    await run_job(worker_context(settings, worker_redis, "w-sweep"), started)
    young = await store_job(redis, "req_young")
    await redis.zadd(
        keys.inflight("tiny-test"),
        {waiting.request_id: old, started.request_id: old, "req_expired": old},
    )
    await redis.zadd(keys.inflight("tiny-test"), {young.request_id: time.time() * 1000})

    assert await sweep_unstarted(redis, settings) == [waiting.request_id]
    events = await stored(redis, waiting.request_id)
    check_stream(events)
    assert is_timeout(events)
    check_stream(await stored(redis, started.request_id))  # untouched: one terminal, its own
    assert await redis.xlen(keys.events(young.request_id)) == 0  # not old enough yet
    assert await redis.exists(keys.events("req_expired")) == 0  # no hash: nothing written
    assert await redis.zscore(keys.inflight("tiny-test"), "req_expired") is None
    assert await sweep_unstarted(redis, settings) == []  # idempotent


async def test_the_start_deadline_is_the_request_s_own(
    redis: aioredis.Redis, settings: Settings
) -> None:
    """A request's ``start_by`` rules, not the sweeping replica's ``start_timeout_s``: a replica
    set to ten minutes still ends a request admitted with a short deadline, and one set to 0.6 s
    leaves alone a request admitted with a long one."""
    await redis.sadd(keys.models(), "tiny-test")  # type: ignore[misc]
    now = time.time()
    short = await store_job(redis, "req_short", age_s=2, start_by=now - 1)
    long = await store_job(redis, "req_long", age_s=60, start_by=now + 600)
    await redis.zadd(
        keys.inflight("tiny-test"), {r.request_id: r.created * 1000 for r in (short, long)}
    )

    patient = msgspec.structs.replace(settings, start_timeout_s=600.0)
    assert await sweep_unstarted(redis, patient) == [short.request_id]
    events = await stored(redis, short.request_id)
    assert is_timeout(events) and "within 1s" in events[0].message
    assert await sweep_unstarted(redis, settings) == []  # 0.6 s here, yet req_long has 10 min
    deadline = await start_deadline(redis, long.request_id, settings)
    assert 590 < deadline - time.monotonic() <= 600


async def test_admission_stores_the_admitting_api_s_deadline(
    api: str, redis: aioredis.Redis, settings: Settings, tiny_model: ModelCard
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
    created, start_by = await redis.hmget(keys.request(rid), ["created", "start_by"])  # type: ignore[misc]
    assert float(start_by) - float(created) == pytest.approx(settings.start_timeout_s)


async def test_nobody_watching_still_times_out(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    """The API's sweep ends a request that no client streams (e.g. a background request)."""
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
    reply = await redis.xread({keys.events(rid): "0-0"}, block=10_000)
    assert reply, "no Error within 10 s of a 0.6 s start timeout"
    events = decode_entries(reply[0][1])
    check_stream(events)
    assert is_timeout(events)
