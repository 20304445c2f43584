"""The queue's interface (``services.queue.Queue``) against an in-process fakeredis.

fakeredis runs the bounded enqueue's Lua through ``lupa``, as for the lease scripts
(tests/unit/shared/test_protocol.py). Jobs are "picked up" here by writing the in-progress
marker arq's worker writes, so the sweeper's view (``runs``, ``running_ids``, ``repair``) is
checked without a worker; the integration and chaos suites run the real consumer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import fakeredis
import pytest
from arq.jobs import deserialize_job_raw

from services.queue import DUPLICATE, ENQUEUED, QUEUE_FULL, Queue, arq_keys
from services.queue.arq_keys import JOB_FUNCTION
from services.queue.client import JOB_TIMEOUT_S
from services.queue.consumer import arq_deserialize
from shared import keys

MODEL = "m"
EXPIRES_MS = 60_000


@pytest.fixture
async def fake() -> AsyncIterator[fakeredis.FakeAsyncRedis]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


@pytest.fixture
def queue(fake: fakeredis.FakeAsyncRedis) -> Queue:
    return Queue(fake)


async def enqueue(queue: Queue, jid: str, *, bound: int = 100, at_ms: int = 1_000) -> int:
    return await queue.enqueue(
        MODEL, jid, b"job:" + jid.encode(), enqueue_ms=at_ms, expires_ms=EXPIRES_MS, bound=bound
    )


async def pick_up(fake: fakeredis.FakeAsyncRedis, jid: str, ago_ms: int = 0) -> None:
    """What arq's worker writes when it starts a job: the in-progress marker, its TTL the job
    timeout plus ``IN_PROGRESS_EXTRA_S`` (less ``ago_ms`` for a job started that long ago)."""
    ttl_ms = int((JOB_TIMEOUT_S + arq_keys.IN_PROGRESS_EXTRA_S) * 1000) - ago_ms
    await fake.set(arq_keys.in_progress(jid), b"1", px=ttl_ms)


async def test_concurrent_admissions_never_pass_the_bound(queue: Queue) -> None:
    """A burst enqueued at once: exactly ``bound`` get in, the rest are refused as full."""
    results = await asyncio.gather(*(enqueue(queue, f"j{i}", bound=5) for i in range(40)))
    assert results.count(ENQUEUED) == 5
    assert results.count(QUEUE_FULL) == 35
    assert await queue.size(MODEL) == 5


async def test_a_duplicate_id_is_a_no_op_while_queued_or_finished(
    queue: Queue, fake: fakeredis.FakeAsyncRedis
) -> None:
    assert await enqueue(queue, "a") == ENQUEUED
    assert await enqueue(queue, "a") == DUPLICATE
    assert await queue.size(MODEL) == 1
    await fake.set(arq_keys.result("done"), b"x")  # a finished job's result keeps its id taken
    assert await enqueue(queue, "done") == DUPLICATE
    await queue.forget("done")
    assert await enqueue(queue, "done") == ENQUEUED


async def test_a_full_queue_refuses_even_a_known_id_only_after_the_duplicate_check(
    queue: Queue,
) -> None:
    """A duplicate is reported as such at the bound, so a retried admission is not a 429."""
    assert await enqueue(queue, "a", bound=1) == ENQUEUED
    assert await enqueue(queue, "a", bound=1) == DUPLICATE
    assert await enqueue(queue, "b", bound=1) == QUEUE_FULL


async def test_the_payload_is_the_envelope_arq_runs(
    queue: Queue, fake: fakeredis.FakeAsyncRedis
) -> None:
    assert await enqueue(queue, "a", at_ms=1234) == ENQUEUED
    raw = await fake.get(arq_keys.job("a"))
    assert raw is not None
    function, args, _, _, enqueue_ms = deserialize_job_raw(raw, deserializer=arq_deserialize)
    assert (function, list(args), enqueue_ms) == (JOB_FUNCTION, [b"job:a"], 1234)
    assert 0 < await fake.pttl(arq_keys.job("a")) <= EXPIRES_MS


async def test_enqueue_rings_the_doorbell(queue: Queue, fake: fakeredis.FakeAsyncRedis) -> None:
    pubsub = fake.pubsub()
    await pubsub.subscribe(keys.queue(MODEL))
    assert (await pubsub.get_message(timeout=1))["type"] == "subscribe"
    assert await enqueue(queue, "a", at_ms=777) == ENQUEUED
    message = await pubsub.get_message(timeout=1)
    assert message is not None and message["data"] == b"777"
    await pubsub.aclose()  # type: ignore[no-untyped-call]


async def test_waiting_skips_picked_up_jobs_oldest_first(
    queue: Queue, fake: fakeredis.FakeAsyncRedis
) -> None:
    for jid, at in (("late", 3_000), ("early", 1_000), ("running", 500)):
        assert await enqueue(queue, jid, at_ms=at) == ENQUEUED
    await pick_up(fake, "running")
    assert await queue.waiting(MODEL) == [("early", 1_000.0), ("late", 3_000.0)]
    assert await queue.size(MODEL) == 3  # the bound counts running jobs too


async def test_remove_takes_a_job_out_before_it_starts(
    queue: Queue, fake: fakeredis.FakeAsyncRedis
) -> None:
    assert await enqueue(queue, "a") == ENQUEUED
    assert await enqueue(queue, "b") == ENQUEUED
    await queue.remove(MODEL, "a")
    assert await queue.waiting(MODEL) == [("b", 1_000.0)]
    assert not await fake.exists(arq_keys.job("a"))
    await queue.remove(None, "b")  # queue unknown: the payload goes, so arq would skip it
    assert not await fake.exists(arq_keys.job("b"))
    assert await enqueue(queue, "a") == ENQUEUED  # no result was left: the id is free


async def test_runs_tell_waiting_running_and_gone(
    queue: Queue, fake: fakeredis.FakeAsyncRedis
) -> None:
    for jid in ("waiting", "running"):
        assert await enqueue(queue, jid) == ENQUEUED
    await pick_up(fake, "running", ago_ms=4_000)
    await fake.set(arq_keys.in_progress("forever"), b"1")  # a marker without a TTL
    waiting, running, gone, forever = await queue.runs(
        MODEL, ["waiting", "running", "gone", "forever"]
    )
    assert (waiting.queued, waiting.running, waiting.running_for_ms) == (True, False, None)
    assert (running.queued, running.running) == (True, True)
    assert running.running_for_ms is not None and running.running_for_ms >= 4_000
    assert (gone.queued, gone.running, gone.running_for_ms) == (False, False, None)
    assert (forever.queued, forever.running, forever.running_for_ms) == (False, True, None)


async def test_repair_removes_every_trace_of_a_dead_run(
    queue: Queue, fake: fakeredis.FakeAsyncRedis
) -> None:
    """A SIGKILLed worker's run stays queued with its marker for hours; ``repair`` drops it,
    and leaves the queue's other jobs alone."""
    for jid in ("dead", "dead:2", "alive", "next"):
        assert await enqueue(queue, jid) == ENQUEUED
    for jid in ("dead", "dead:2", "alive"):
        await pick_up(fake, jid)
    assert await queue.running_ids(MODEL, 10) == ["alive", "dead", "dead:2"]
    await queue.repair(MODEL, ["dead", "dead:2"])
    assert await queue.running_ids(MODEL, 10) == ["alive"]
    assert await queue.waiting(MODEL) == [("next", 1_000.0)]
    for jid in ("dead", "dead:2"):
        assert not await fake.exists(arq_keys.in_progress(jid), arq_keys.job(jid))
    assert await queue.size(MODEL) == 2
    await queue.repair(MODEL, [])  # nothing to do is no command


async def test_running_ids_look_only_at_the_head_of_the_queue(
    queue: Queue, fake: fakeredis.FakeAsyncRedis
) -> None:
    """Only the ids a poll reads matter (arq's ``queue_read_limit``)."""
    for i in range(4):
        assert await enqueue(queue, f"j{i}", at_ms=1_000 + i) == ENQUEUED
        await pick_up(fake, f"j{i}")
    assert await queue.running_ids(MODEL, 2) == ["j0", "j1"]
    assert await Queue(fake).running_ids("other", 2) == []
