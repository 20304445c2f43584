"""``Queue.enqueue_all``: the n choices of one request enter the queue together or not at all.

Against fakeredis with the script run through ``lupa``, as ``test_queue.py`` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import fakeredis
import pytest
from arq.jobs import deserialize_job_raw

from services.queue import DUPLICATE, ENQUEUED, QUEUE_FULL, Queue, arq_keys
from services.queue.consumer import arq_deserialize
from shared import keys

MODEL = "m"


@pytest.fixture
async def fake() -> AsyncIterator[fakeredis.FakeAsyncRedis]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


def jobs(rid: str, n: int) -> list[tuple[str, bytes]]:
    return [(f"{rid}.{i}", f"job:{rid}.{i}".encode()) for i in range(n)]


async def put(queue: Queue, rid: str, n: int, bound: int = 100) -> int:
    return await queue.enqueue_all(
        MODEL, jobs(rid, n), enqueue_ms=1_000, expires_ms=60_000, bound=bound
    )


async def test_all_jobs_are_queued_with_one_score_and_their_payloads(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    queue = Queue(fake)
    assert await put(queue, "r", 3) == ENQUEUED
    members = await fake.zrange(keys.queue(MODEL), 0, -1, withscores=True)
    assert members == [(b"r.0", 1000.0), (b"r.1", 1000.0), (b"r.2", 1000.0)]
    for jid, payload in jobs("r", 3):
        raw = await fake.get(arq_keys.job(jid))
        assert list(deserialize_job_raw(raw, deserializer=arq_deserialize)[1]) == [payload]


async def test_a_request_that_does_not_fit_whole_queues_nothing(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    queue = Queue(fake)
    assert await put(queue, "a", 2, bound=4) == ENQUEUED
    assert await put(queue, "b", 3, bound=4) == QUEUE_FULL  # 2 + 3 > 4: not 2 of 3
    assert await queue.size(MODEL) == 2
    assert await fake.exists(*(arq_keys.job(j) for j, _ in jobs("b", 3))) == 0
    assert await put(queue, "c", 2, bound=4) == ENQUEUED  # exactly full


async def test_a_known_id_makes_the_whole_request_a_duplicate(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    queue = Queue(fake)
    await fake.set(arq_keys.result("r.1"), b"done")
    assert await put(queue, "r", 3) == DUPLICATE
    assert await queue.size(MODEL) == 0


async def test_a_burst_never_overshoots_the_bound(fake: fakeredis.FakeAsyncRedis) -> None:
    queue = Queue(fake)
    results = await asyncio.gather(*(put(queue, f"r{i}", 3, bound=10) for i in range(10)))
    assert results.count(ENQUEUED) == 3 and await queue.size(MODEL) == 9
