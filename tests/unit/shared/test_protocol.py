"""The Redis protocol's scripts (``shared.protocol``), each against an in-process fakeredis.

fakeredis runs the Lua through ``lupa`` (the ``fakeredis[lua]`` extra), so every transition of
the lease table in ``shared.protocol`` is checked here without a Redis server: take, refresh,
release, fencing, the cancel flag riding on a publish, the API's start-timeout claim and the
sweeper's recovery claim. Each test gets its own ``FakeServer``.

What fakeredis does not prove, and the integration tests on real Redis do
(tests/integration/test_worker_bus.py, test_api_start_timeout.py, test_failover_sdk.py,
tests/unit/worker/test_publisher.py): races between real connections (fakeredis runs each
command to completion in-process, so there is no interleaving to lose), ``MAXLEN ~`` trimming
(approximate by design, node-sized on real Redis), and TTLs measured by a server clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import fakeredis
import pytest

from shared import keys
from shared.codec import SCHEMA_VERSION, decode_entry, encode_events
from shared.events import AnyEvent, Error, Start, TextDelta
from shared.protocol import (
    API_TIMEOUT_OWNER,
    LEASE_LOST,
    RECOVERING,
    Claim,
    Scripts,
    claim_lost,
    recovering_owner,
)

RID = "req-proto"
LEASE_MS = 3000
RETENTION_S = 120
UNSTORED_S = 7


@pytest.fixture
async def fake() -> AsyncIterator[fakeredis.FakeAsyncRedis]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


@pytest.fixture
def scripts(fake: fakeredis.FakeAsyncRedis) -> Scripts:
    return Scripts(fake)


async def publish(scripts: Scripts, owner: str, *events: AnyEvent, ttl: int = RETENTION_S) -> int:
    call = Scripts.publish_call(
        RID, owner, encode_events(events), lease_ms=LEASE_MS, maxlen=1000, retention_s=ttl
    )
    return await scripts.publish(*call)


def start() -> Start:
    return Start(request_id=RID, model="m", prompt_tokens=3)


async def holder(fake: fakeredis.FakeAsyncRedis) -> str | None:
    value = await fake.get(keys.lease(RID))
    return None if value is None else value.decode()


# --- acquire / release -------------------------------------------------------------------------


async def test_acquire_takes_a_free_lease_with_its_ttl(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    assert await scripts.acquire(RID, "w1", LEASE_MS)
    assert await holder(fake) == "w1"
    assert 0 < await fake.pttl(keys.lease(RID)) <= LEASE_MS
    assert await scripts.acquire(RID, "w1", LEASE_MS)  # already ours: still ours


@pytest.mark.parametrize("other", ["w2", API_TIMEOUT_OWNER])
async def test_acquire_refuses_another_holder(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts, other: str
) -> None:
    await fake.set(keys.lease(RID), other)
    assert not await scripts.acquire(RID, "w1", LEASE_MS)
    assert await holder(fake) == other


async def test_acquire_takes_over_a_recovery_claim(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    # The script spells the prefix and its length itself: this is what keeps them in step.
    claim = recovering_owner("sweeper")
    assert claim.startswith(RECOVERING)
    assert await claim_lost(fake, RID, "sweeper", LEASE_MS) == claim
    assert await scripts.acquire(RID, "w1", LEASE_MS)
    assert await holder(fake) == "w1"


async def test_release_only_drops_our_own_lease(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    await fake.set(keys.lease(RID), "w2")
    assert not await scripts.release(RID, "w1")
    assert await holder(fake) == "w2"
    await fake.set(keys.lease(RID), "w1")
    assert await scripts.release(RID, "w1")
    assert await holder(fake) is None
    assert not await scripts.release(RID, "w1")  # gone already


# --- publish -----------------------------------------------------------------------------------


async def test_publish_appends_one_entry_per_step_and_sets_the_ttl(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    assert await scripts.acquire(RID, "w1", LEASE_MS)
    events = [start(), TextDelta(text="a", token_ids=[1])]
    assert await publish(scripts, "w1", *events) == 0
    entries = await fake.xrange(keys.events(RID))
    assert [set(f) for _, f in entries] == [{b"v", b"e"}]
    assert {f[b"v"] for _, f in entries} == {str(SCHEMA_VERSION).encode()}
    assert [decode_entry(f) for _, f in entries] == [events]
    assert 0 < await fake.ttl(keys.events(RID)) <= RETENTION_S


async def test_publish_with_ttl_0_leaves_the_ttl(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    assert await publish(scripts, "w1", start(), ttl=RETENTION_S) == 0
    await fake.expire(keys.events(RID), 7)
    assert await publish(scripts, "w1", TextDelta(text="a", token_ids=[1]), ttl=0) == 0
    assert 0 < await fake.ttl(keys.events(RID)) <= 7
    assert await fake.xlen(keys.events(RID)) == 2


async def test_publish_returns_the_cancel_flag(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    assert await scripts.acquire(RID, "w1", LEASE_MS)
    await fake.set(keys.cancel(RID), 1)
    assert await publish(scripts, "w1", start()) == 1
    assert await fake.xlen(keys.events(RID)) == 1  # written all the same: the caller stops next


async def test_publish_is_fenced_by_another_owner(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    assert await scripts.acquire(RID, "w1", LEASE_MS)
    await publish(scripts, "w1", start())
    await fake.set(keys.lease(RID), "w2")  # a sweeper handed the request on
    assert await publish(scripts, "w1", TextDelta(text="late", token_ids=[9])) == LEASE_LOST
    assert await fake.xlen(keys.events(RID)) == 1
    assert await holder(fake) == "w2"


async def test_publish_retakes_its_own_expired_lease(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    # A slow step outlived the lease and nobody took the request meanwhile.
    assert await publish(scripts, "w1", start()) == 0
    assert await holder(fake) == "w1"
    assert 0 < await fake.pttl(keys.lease(RID)) <= LEASE_MS


# --- refresh -----------------------------------------------------------------------------------


async def test_refresh_extends_our_lease_and_reads_the_cancel_flag(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    await fake.set(keys.lease(RID), "w1", px=100)
    async with fake.pipeline(transaction=False) as pipe:
        await scripts.queue_refresh(pipe, RID, "w1", LEASE_MS)
        assert await pipe.execute() == [0]
    assert await fake.pttl(keys.lease(RID)) > 100
    await fake.set(keys.cancel(RID), 1)
    async with fake.pipeline(transaction=False) as pipe:
        await scripts.queue_refresh(pipe, RID, "w1", LEASE_MS)
        assert await pipe.execute() == [1]


async def test_refresh_retakes_a_lost_lease_unless_someone_holds_it(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    async with fake.pipeline(transaction=False) as pipe:
        await scripts.queue_refresh(pipe, RID, "w1", LEASE_MS)
        await scripts.queue_refresh(pipe, RID, "w2", LEASE_MS)
        assert await pipe.execute() == [0, LEASE_LOST]
    assert await holder(fake) == "w1"


# --- the sweeper's recovery claim ----------------------------------------------------------------


async def test_claim_lost_is_first_come(fake: fakeredis.FakeAsyncRedis, scripts: Scripts) -> None:
    assert await claim_lost(fake, RID, "s1", LEASE_MS) == "recovering:s1"
    assert await claim_lost(fake, RID, "s2", LEASE_MS) is None
    assert await holder(fake) == "recovering:s1"
    # The sweeper that gives up writes its Error under the claim; the old worker stays fenced.
    error = Error(kind="worker_lost", message="gone")
    assert await publish(scripts, "recovering:s1", error) == 0
    assert await publish(scripts, "w1", TextDelta(text="late", token_ids=[9])) == LEASE_LOST


async def test_claim_lost_refuses_a_live_lease(fake: fakeredis.FakeAsyncRedis) -> None:
    await fake.set(keys.lease(RID), "w1")
    assert await claim_lost(fake, RID, "s1", LEASE_MS) is None


# --- the API's start-timeout claim ---------------------------------------------------------------


async def claim(scripts: Scripts) -> int:
    body = encode_events([Error(kind="overloaded", message="late", retryable=True)])
    return await scripts.claim_unstarted(
        RID,
        body,
        lease_ms=RETENTION_S * 1000,
        maxlen=1000,
        retention_s=RETENTION_S,
        unstored_retention_s=UNSTORED_S,
    )


async def test_claim_unstarted_ends_the_request_and_fences_workers(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    await fake.hset(keys.request(RID), "model", "m")
    assert await claim(scripts) == Claim.TIMED_OUT
    history = [decode_entry(f) for _, f in await fake.xrange(keys.events(RID))]
    assert history == [[Error(kind="overloaded", message="late", retryable=True)]]
    assert await holder(fake) == API_TIMEOUT_OWNER
    assert await fake.pttl(keys.lease(RID)) > LEASE_MS  # outlives the stream's readers
    assert 0 < await fake.ttl(keys.events(RID)) <= RETENTION_S
    # A worker arriving now neither takes the lease nor writes.
    assert not await scripts.acquire(RID, "w1", LEASE_MS)
    assert await publish(scripts, "w1", start()) == LEASE_LOST
    assert await claim(scripts) == Claim.STARTED  # a second API process backs off
    assert await fake.xlen(keys.events(RID)) == 1


async def test_claim_unstarted_leaves_a_started_request(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    await fake.hset(keys.request(RID), "model", "m")
    assert await scripts.acquire(RID, "w1", LEASE_MS)
    await publish(scripts, "w1", start())
    await scripts.release(RID, "w1")  # even without the lease, events mean it started
    assert await claim(scripts) == Claim.STARTED
    assert await fake.xlen(keys.events(RID)) == 1


@pytest.mark.parametrize("owner", ["w1", "recovering:s1"])
async def test_claim_unstarted_backs_off_a_held_lease(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts, owner: str
) -> None:
    await fake.hset(keys.request(RID), "model", "m")
    await fake.set(keys.lease(RID), owner)
    assert await claim(scripts) == Claim.HELD
    assert await fake.xlen(keys.events(RID)) == 0
    assert await holder(fake) == owner


async def test_claim_unstarted_ignores_a_gone_request(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    assert await claim(scripts) == Claim.GONE
    assert await fake.exists(keys.events(RID), keys.lease(RID)) == 0


# --- running the scripts -------------------------------------------------------------------------


async def test_scripts_survive_a_flushed_script_cache(
    fake: fakeredis.FakeAsyncRedis, scripts: Scripts
) -> None:
    """A restarted Redis forgets its scripts: calls reload them (NOSCRIPT), pipelines preload."""
    assert await scripts.acquire(RID, "w1", LEASE_MS)
    await fake.script_flush()
    assert await publish(scripts, "w1", start()) == 0
    await fake.script_flush()
    async with fake.pipeline(transaction=False) as pipe:
        await scripts.queue_acquire(pipe, RID, "w1", LEASE_MS)
        await scripts.queue_refresh(pipe, RID, "w1", LEASE_MS)
        assert await pipe.execute() == [1, 0]
