"""The stream hub against real Redis: fan-out, resume ids, back-pressure, wake-up, reconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.api.hub import StreamHub, Subscription, SubscriptionFailed, parse_id

pytestmark = pytest.mark.integration


async def fill(redis: aioredis.Redis, key: str, n: int, tag: str = "x") -> list[str]:
    ids = []
    for i in range(n):
        raw: bytes = await redis.xadd(key, {"i": f"{tag}{i}"})
        ids.append(raw.decode())
    return ids


async def take(sub: Subscription, n: int) -> list[str]:
    """The next ``n`` entry ids (entries may arrive over several XREADs)."""
    ids: list[str] = []
    while len(ids) < n:
        batch = await sub.get_batch(5)
        assert batch, f"only {len(ids)} of {n} entries arrived"
        ids.extend(e[0] for e in batch)
    return ids


@pytest.fixture
async def hub(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[StreamHub]:
    hub = StreamHub(redis_url, redis, block_ms=2_000, high_water=4)
    await hub.start()
    yield hub
    await hub.stop()


def test_parse_id() -> None:
    assert parse_id("0-0") == (0, 0)
    assert parse_id("1700000000000-12") == (1_700_000_000_000, 12)
    assert parse_id("5") == (5, 0)
    assert parse_id("9-1") > parse_id("9-0") > parse_id("8-99")
    assert parse_id("18446744073709551615-18446744073709551615") == (2**64 - 1, 2**64 - 1)
    for bad in ("x", "-1-0", "1-x", "", "18446744073709551616-0", "0-18446744073709551616",
                "+1-0", "1_0-0", " 1-0", "1-0-0", "١-0"):  # fmt: skip
        with pytest.raises(ValueError):  # noqa: PT011 - int() says which part is wrong
            parse_id(bad)


async def test_a_key_redis_rejects_fails_only_its_own_subscription(
    hub: StreamHub, redis: aioredis.Redis
) -> None:
    """One subscription Redis refuses (a key of another type) must not stop the others."""
    await redis.set("not-a-stream", b"x")
    good = await hub.subscribe("s")
    poisoned = await hub.subscribe("not-a-stream")
    ids = await fill(redis, "s", 2)
    assert await take(good, 2) == ids
    with pytest.raises(SubscriptionFailed, match="WRONGTYPE"):
        await poisoned.get_batch(5)
    assert not hub.watching("not-a-stream")
    more = await fill(redis, "s", 1, "y")
    assert await take(good, 1) == more


async def test_subscribers_get_entries_after_their_cursor(
    hub: StreamHub, redis: aioredis.Redis
) -> None:
    ids = await fill(redis, "s", 3)
    whole = await hub.subscribe("s")
    tail = await hub.subscribe("s", after=ids[1])
    assert await take(whole, 3) == ids
    assert await take(tail, 1) == ids[2:]
    more = await fill(redis, "s", 2, "y")
    assert await take(whole, 2) == more
    assert await take(tail, 2) == more
    assert await whole.get_batch(0.05) == []  # silence: an empty batch, not an error


async def test_a_new_subscription_wakes_the_blocked_read(
    redis_url: str, redis: aioredis.Redis
) -> None:
    hub = StreamHub(redis_url, redis, block_ms=60_000)
    await hub.start()
    try:
        first = await hub.subscribe("a")
        await fill(redis, "a", 1)
        assert len(await first.get_batch(10)) == 1
        calls = hub.xread_calls
        # the reader is now blocked (60 s) on "a" alone; "b" must not wait that out
        late = await hub.subscribe("b")
        (entry_id,) = await fill(redis, "b", 1)
        got = await late.get_batch(30)
        assert [e[0] for e in got] == [entry_id]
        assert hub.xread_calls > calls
    finally:
        await hub.stop()  # also must not wait out the block


async def test_slow_subscriber_is_paused_without_stalling_others(
    hub: StreamHub, redis: aioredis.Redis
) -> None:
    slow = await hub.subscribe("slow")
    fast = await hub.subscribe("fast")
    slow_ids = await fill(redis, "slow", 20)
    for i in range(10):
        (fid,) = await fill(redis, "fast", 1, f"f{i}")
        assert [e[0] for e in await fast.get_batch(5)] == [fid]
    assert slow.paused  # buffer reached high water; the hub stopped reading its key
    received: list[str] = []
    while len(received) < 20:
        batch = await slow.get_batch(5, limit=3)
        assert batch, "paused subscriber was never resumed"
        received.extend(e[0] for e in batch)
    assert received == slow_ids  # in order, nothing lost or repeated across pause/resume
    assert not slow.paused


async def test_unsubscribe_and_stop(hub: StreamHub, redis: aioredis.Redis) -> None:
    sub = await hub.subscribe("u")
    assert hub.watching("u") and hub.subscriptions == 1
    hub.unsubscribe(sub)
    hub.unsubscribe(sub)  # idempotent
    assert not hub.watching("u") and hub.subscriptions == 0
    other = await hub.subscribe("v")
    await hub.stop()
    from services.api.hub import HubClosed

    with pytest.raises(HubClosed):
        await other.get_batch(1)


async def test_reader_survives_a_killed_connection(hub: StreamHub, redis: aioredis.Redis) -> None:
    sub = await hub.subscribe("k")
    before = await fill(redis, "k", 2)
    assert await take(sub, 2) == before
    # only this hub's blocking connection: the server is shared with other databases' users
    db = redis.connection_pool.connection_kwargs.get("db", 0)
    ours = [
        c["id"]
        for c in await redis.client_list()
        if c.get("name") == "sluice-hub" and int(c.get("db", -1)) == db
    ]
    assert len(ours) == 1
    await redis.client_kill_filter(_id=ours[0])
    after = await fill(redis, "k", 3)
    assert await take(sub, 3) == after  # resumed from its cursor: nothing lost or repeated


async def test_a_blocked_wait_ends_on_stop_or_silence(
    hub: StreamHub, redis: aioredis.Redis
) -> None:
    from services.api.hub import HubClosed

    sub = await hub.subscribe("w")
    assert await sub.get_batch(0.01) == []  # the timer ends a silent wait with an empty batch
    (entry_id,) = await fill(redis, "w", 1)
    assert [e[0] for e in await sub.get_batch(5)] == [entry_id]  # and a live one with entries
    waiter = asyncio.ensure_future(sub.get_batch(30))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await hub.stop()
    with pytest.raises(HubClosed):
        await waiter


async def test_a_subscription_cancelled_while_subscribing_leaves_nothing(hub: StreamHub) -> None:
    """A client gone while its subscription's wake-up is on the wire (right after the headers)
    must not leave the key watched: the disconnect cancel is skipped while a key is watched."""
    await asyncio.sleep(0.2)  # the reader is blocked in XREAD, so subscribing sends a wake-up

    async def client() -> None:
        async with hub.subscription("gone"):
            await asyncio.sleep(30)

    task = asyncio.create_task(client())
    await asyncio.sleep(0)  # it runs until the wake-up's round trip
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not hub.watching("gone")
