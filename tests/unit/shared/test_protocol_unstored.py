"""``store: false`` in the protocol's scripts, against an in-process fakeredis: the terminal
publish and the API's start-timeout claim cut the stream and the request hash down to the
unstored retention in the same atomic step that writes the terminal event, and only then."""

from __future__ import annotations

from collections.abc import AsyncIterator

import fakeredis
import pytest

from shared import keys
from shared.codec import encode_events
from shared.events import Error, Finish, Start
from shared.protocol import LEASE_LOST, Claim, Scripts

RID = "req-unstored"
LEASE_MS = 3000
RETENTION_S = 1000
UNSTORED_S = 7


@pytest.fixture
async def fake() -> AsyncIterator[fakeredis.FakeAsyncRedis]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


async def request_hash(fake: fakeredis.FakeAsyncRedis, store: str | None) -> None:
    fields = {"model": "m"} | ({} if store is None else {"store": store})
    await fake.hset(keys.request(RID), mapping=fields)
    await fake.expire(keys.request(RID), RETENTION_S)


async def claim(fake: fakeredis.FakeAsyncRedis) -> int:
    body = encode_events([Error(kind="overloaded", message="late", retryable=True)])
    return await Scripts(fake).claim_unstarted(
        RID,
        body,
        lease_ms=RETENTION_S * 1000,
        maxlen=1000,
        retention_s=RETENTION_S,
        unstored_retention_s=UNSTORED_S,
    )


async def test_publish_expires_the_extra_keys_with_the_stream(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    await request_hash(fake, "0")
    body = encode_events(
        [Start(request_id=RID, model="m", prompt_tokens=1), Finish(reason="end_turn")]
    )
    await Scripts(fake).publish(
        *Scripts.publish_call(
            RID,
            "w1",
            body,
            lease_ms=LEASE_MS,
            maxlen=1000,
            retention_s=UNSTORED_S,
            also_expire=[keys.request(RID)],
        )
    )
    assert 0 < await fake.ttl(keys.events(RID)) <= UNSTORED_S
    assert 0 < await fake.ttl(keys.request(RID)) <= UNSTORED_S
    assert 0 < await fake.pttl(keys.lease(RID)) <= LEASE_MS  # the lease keeps its own TTL


async def test_a_fenced_publish_expires_nothing(fake: fakeredis.FakeAsyncRedis) -> None:
    await request_hash(fake, "0")
    await fake.set(keys.lease(RID), "w2")
    result = await Scripts(fake).publish(
        *Scripts.publish_call(
            RID,
            "w1",
            encode_events([Finish(reason="end_turn")]),
            lease_ms=LEASE_MS,
            maxlen=1000,
            retention_s=UNSTORED_S,
            also_expire=[keys.request(RID)],
        )
    )
    assert result == LEASE_LOST
    assert await fake.ttl(keys.request(RID)) > UNSTORED_S


async def test_start_timeout_of_an_unstored_request_keeps_only_the_window(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    await request_hash(fake, "0")
    assert await claim(fake) == Claim.TIMED_OUT
    assert 0 < await fake.ttl(keys.events(RID)) <= UNSTORED_S
    assert 0 < await fake.ttl(keys.request(RID)) <= UNSTORED_S


@pytest.mark.parametrize("store", ["1", None])  # None: a hash written before the flag existed
async def test_start_timeout_of_a_stored_request_keeps_the_retention(
    fake: fakeredis.FakeAsyncRedis, store: str | None
) -> None:
    await request_hash(fake, store)
    assert await claim(fake) == Claim.TIMED_OUT
    assert UNSTORED_S < await fake.ttl(keys.events(RID)) <= RETENTION_S
    assert UNSTORED_S < await fake.ttl(keys.request(RID)) <= RETENTION_S
