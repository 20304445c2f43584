"""The worker side of the bus against real Redis: jobs in through arq, events out on the stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from services.queue import ENQUEUED, Queue, arq_keys
from services.worker.recovery import ORPHAN_SCAN, sweep_once, sweep_orphans
from services.worker.scripted import ScriptedBackend, parse_spec
from shared import keys
from shared.codec import decode_entry, encode_job
from shared.events import AnyEvent, Error, Finish, Start, TextDelta, Usage, is_terminal
from shared.jobs import GenerateRequest, Job, Message, TextPart
from tests.integration.worker_harness import FAST_FAILOVER, running_worker
from tests.invariants import check_stream, generated_token_ids
from tests.job_factory import tokenize
from tests.metrics_text import sample

pytestmark = pytest.mark.integration


# Every scripted model renders prompts with the same ChatML card, whatever its scenario.
SCRIPTED_CARD = parse_spec("scripted:text").card


def make_job(rid: str, model: str, script: str | None = None, text: str = "hi") -> Job:
    """The job the API would enqueue: rendered and tokenized with the scripted models' card."""
    request = GenerateRequest(
        request_id=rid,
        model=model,
        messages=[Message(role="user", content=[TextPart(text)])],
        metadata={"script": script} if script else {},
    )
    return tokenize(request, SCRIPTED_CARD)


async def submit(
    redis_url: str,
    job: Job,
    job_id: str | None = None,
    *,
    expires_s: float = 60,
    enqueue_ms: int | None = None,
) -> bool:
    """Do what the API does: request hash, in-flight entry, job (id = request id) queued through
    ``Queue.enqueue`` (which rings the queue's doorbell), at ``enqueue_ms`` (default: now)."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        payload = encode_job(job)
        await redis.hset(keys.request(job.request_id), mapping={"job": payload, "model": job.model})
        await redis.zadd(keys.inflight(job.model), {job.request_id: 0}, nx=True)
        at = enqueue_ms if enqueue_ms is not None else int(time.time() * 1000)
        enqueued = await Queue(redis).enqueue(
            job.model, job_id or job.request_id, payload, enqueue_ms=at,
            expires_ms=int(expires_s * 1000), bound=2**53,
        )  # fmt: skip
        return enqueued == ENQUEUED
    finally:
        await redis.aclose()


async def read_stream(
    redis: aioredis.Redis, rid: str, *, until: int | None = None
) -> list[AnyEvent]:
    """Tail the stream from 0-0 until the terminal event (or until ``until`` events)."""
    events: list[AnyEvent] = []
    last = "0-0"
    async with asyncio.timeout(30):
        while True:
            reply = await redis.xread({keys.events(rid): last}, block=1000)
            for _, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    events.extend(decode_entry(fields))
            if events and is_terminal(events[-1]):
                return events
            if until is not None and len(events) >= until:
                return events


async def test_job_streams_events_and_cleans_up(redis: aioredis.Redis, redis_url: str) -> None:
    async with running_worker(redis_url, "scripted:reasoning?rate=0") as worker:
        assert await submit(redis_url, make_job("req-1", worker.name))
        events = await read_stream(redis, "req-1")
        check_stream(events)
        assert isinstance(events[0], Start) and events[0].model == "scripted-reasoning"
        assert isinstance(events[-1], Finish) and events[-1].reason == "end_turn"
        backend = worker.backend
        assert isinstance(backend, ScriptedBackend)
        text = backend.tokenizer.decode(generated_token_ids(events), skip_special_tokens=False)
        assert text.startswith("<think>") and text.endswith("<|im_end|>")
        assert 0 < await redis.ttl(keys.events("req-1")) <= worker.settings.retention_s
        for _ in range(100):  # settling (lease, in-flight) happens just after the terminal XADD
            if not await redis.exists(keys.lease("req-1")):
                break
            await asyncio.sleep(0.02)
        assert not await redis.exists(keys.lease("req-1"))
        assert await settled(redis, keys.inflight(worker.name)) == 0
        r: Any = redis  # redis-py's stubs mix sync and async return types for hashes and sets
        assert await r.hexists(keys.model_card(worker.name), "card")
        assert await r.sismember(keys.models(), worker.name)
        beat = await r.hgetall(keys.worker(worker.wid))
        assert beat[b"model"] == worker.name.encode() and beat[b"slots"] == b"16"
        assert {b"active", b"version", b"started"} <= set(beat)
        assert 0 < await redis.pttl(keys.worker(worker.wid)) <= 3000 * worker.settings.heartbeat_s
        assert await redis.zscore(keys.workers(), worker.wid) is not None


async def test_duplicate_enqueue_is_a_no_op(redis: aioredis.Redis, redis_url: str) -> None:
    async with running_worker(redis_url) as worker:
        job = make_job("req-dup", worker.name)
        assert await submit(redis_url, job)
        first = await read_stream(redis, "req-dup")
        # The same id again: refused while arq still holds the finished job, else run as a
        # duplicate; workers keep no results, so either may happen. Neither changes the stream.
        await submit(redis_url, job)
        # Even a job that reaches a worker again (other id) finds the terminal and does nothing.
        assert await submit(redis_url, job, job_id="req-dup:again")
        assert await settled(redis, keys.queue(worker.name)) == 0
        again = await read_stream(redis, "req-dup")
        assert again == first
        check_stream(again)


async def test_two_workers_share_one_queue(redis: aioredis.Redis, redis_url: str) -> None:
    spec = "scripted:text?rate=200&max_batch=1"
    async with running_worker(redis_url, spec) as a, running_worker(redis_url, spec) as b:
        rids = [f"req-share-{i}" for i in range(4)]
        for rid in rids:
            assert await submit(redis_url, make_job(rid, a.name))
        for rid in rids:
            check_stream(await read_stream(redis, rid))
        assert a.running.wc.served >= 1
        assert b.running.wc.served >= 1
        assert a.running.wc.served + b.running.wc.served == 4


async def test_cancel_flag_ends_within_one_step(redis: aioredis.Redis, redis_url: str) -> None:
    async with running_worker(redis_url, "scripted:long?rate=400") as worker:
        assert await submit(redis_url, make_job("req-cancel", worker.name))
        await read_stream(redis, "req-cancel", until=6)
        async with redis.pipeline(transaction=True) as tx:  # flag and stream length, atomically
            tx.set(keys.cancel("req-cancel"), 1, ex=60)
            tx.xlen(keys.events("req-cancel"))
            _, length_at_flag = await tx.execute()
        events = await read_stream(redis, "req-cancel")
        check_stream(events)
        assert isinstance(events[-1], Finish) and events[-1].reason == "cancelled"
        # At most the step in flight when the flag was set, then Usage and Finish.
        assert len(events) <= length_at_flag + 3
        usage = events[-2]
        assert isinstance(usage, Usage)
        assert usage.output_tokens == len(generated_token_ids(events))


async def test_cancel_reaches_a_stuck_step(redis: aioredis.Redis, redis_url: str) -> None:
    # At 0.05 tokens/s the first word takes ~100 s: only the heartbeat can end this request.
    async with running_worker(redis_url, "scripted:long?rate=0.05", FAST_FAILOVER) as worker:
        assert await submit(redis_url, make_job("req-stuck", worker.name))
        await read_stream(redis, "req-stuck", until=1)
        await redis.set(keys.cancel("req-stuck"), 1, ex=60)
        events = await read_stream(redis, "req-stuck")
    check_stream(events)
    assert [type(e) for e in events] == [Start, Usage, Finish]
    assert isinstance(events[-1], Finish) and events[-1].reason == "cancelled"


async def test_cancelled_before_start(redis: aioredis.Redis, redis_url: str) -> None:
    async with running_worker(redis_url) as worker:
        await redis.set(keys.cancel("req-early"), 1, ex=60)
        assert await submit(redis_url, make_job("req-early", worker.name))
        events = await read_stream(redis, "req-early")
        check_stream(events)
        assert len(events) == 1 and isinstance(events[0], Error)
        assert events[0].kind == "cancelled"


async def test_backend_exception_then_next_job(redis: aioredis.Redis, redis_url: str) -> None:
    async with running_worker(redis_url) as worker:
        assert await submit(redis_url, make_job("req-err", worker.name, script="error"))
        failed = await read_stream(redis, "req-err")
        check_stream(failed)
        assert any(isinstance(e, TextDelta) for e in failed)
        assert isinstance(failed[-1], Error) and failed[-1].kind == "internal"
        assert await submit(redis_url, make_job("req-after", worker.name))
        after = await read_stream(redis, "req-after")
        check_stream(after)
        assert isinstance(after[-1], Finish)


async def settled(redis: aioredis.Redis, key: str) -> int:
    """ZCARD of ``key`` once the worker's post-terminal bookkeeping had its chance to run."""
    for _ in range(250):
        if not await redis.zcard(key):
            return 0
        await asyncio.sleep(0.02)
    return int(await redis.zcard(key))


def _starts(events: Sequence[AnyEvent]) -> int:
    return sum(isinstance(e, Start) for e in events)


async def test_killed_worker_is_continued_seamlessly(redis: aioredis.Redis, redis_url: str) -> None:
    async with running_worker(redis_url, "scripted:long?rate=1000", FAST_FAILOVER, "m-fail") as a:
        assert await submit(redis_url, make_job("req-lost", "m-fail"))
        partial = await read_stream(redis, "req-lost", until=10)
        await a.kill()
        assert not is_terminal(partial[-1])
        async with running_worker(redis_url, "scripted:long?rate=0", FAST_FAILOVER, "m-fail") as b:
            events = await read_stream(redis, "req-lost")
            assert await submit(redis_url, make_job("req-whole", b.name))
            reference = await read_stream(redis, "req-whole")
            exposition = generate_latest(b.running.wc.metrics.registry).decode()
    check_stream(events)
    check_stream(reference)
    assert _starts(events) == 1 and isinstance(events[-1], Finish)
    assert generated_token_ids(events) == generated_token_ids(reference)
    assert events[-2] == reference[-2]  # the same Usage: one continuous answer
    r: Any = redis
    assert await r.hget(keys.request("req-lost"), "attempts") == b"1"
    # b's sweeper took the request over and b continued it: both counted, one record kept.
    assert sample(exposition, "sluice_failovers_total", kind="takeover") == 1
    assert sample(exposition, "sluice_failovers_total", kind="continuation") == 1
    [record] = [json.loads(raw) for raw in await r.lrange(keys.failovers(), 0, -1)]
    assert record["request_id"] == "req-lost" and record["kind"] == "takeover"
    assert record["attempt"] == 2 and record["by"] == b.wid


async def test_attempts_exhausted_ends_with_worker_lost(
    redis: aioredis.Redis, redis_url: str
) -> None:
    overrides = {**FAST_FAILOVER, "max_attempts": 1}
    async with running_worker(redis_url, "scripted:long?rate=1000", overrides, "m-x") as a:
        assert await submit(redis_url, make_job("req-gone", "m-x"))
        await read_stream(redis, "req-gone", until=5)
        await a.kill()
        async with running_worker(redis_url, "scripted:long?rate=0", overrides, "m-x"):
            events = await read_stream(redis, "req-gone")
            assert await settled(redis, keys.inflight("m-x")) == 0
    check_stream(events)
    assert isinstance(events[-1], Error) and events[-1].kind == "worker_lost"


async def test_clean_stop_without_peer_ends_in_flight(
    redis: aioredis.Redis, redis_url: str
) -> None:
    async with running_worker(redis_url, "scripted:long?rate=500") as worker:
        assert await submit(redis_url, make_job("req-stop", worker.name))
        await read_stream(redis, "req-stop", until=3)
        await worker.stop(grace_s=0)
        events = await read_stream(redis, "req-stop")
    check_stream(events)
    assert isinstance(events[-1], Error) and events[-1].kind == "worker_lost"
    assert events[-1].retryable
    assert not await redis.exists(keys.worker(worker.wid))


async def test_clean_stop_hands_over_to_a_live_peer(redis: aioredis.Redis, redis_url: str) -> None:
    async with running_worker(redis_url, "scripted:long?rate=500", FAST_FAILOVER, "m-hand") as a:
        assert await submit(redis_url, make_job("req-hand", "m-hand"))
        await read_stream(redis, "req-hand", until=3)
        async with running_worker(redis_url, "scripted:long?rate=0", FAST_FAILOVER, "m-hand") as b:
            await a.stop(grace_s=0)
            events = await read_stream(redis, "req-hand")
            assert await submit(redis_url, make_job("req-hand-ref", b.name))
            reference = await read_stream(redis, "req-hand-ref")
    check_stream(events)
    assert isinstance(events[-1], Finish) and events[-1].reason == "end_turn"
    assert generated_token_ids(events) == generated_token_ids(reference)


async def test_sweeper_leaves_queued_and_live_requests_alone(
    redis: aioredis.Redis, redis_url: str
) -> None:
    spec = "scripted:long?rate=50&max_batch=1"
    async with running_worker(redis_url, spec, FAST_FAILOVER) as worker:
        assert await submit(redis_url, make_job("req-busy", worker.name))
        await read_stream(redis, "req-busy", until=2)
        assert await submit(redis_url, make_job("req-queued", worker.name))  # no free slot
        acted = await sweep_once(worker.running.wc, worker.running.consumer.queue)
        assert acted == []
        assert await sweep_orphans(worker.running.wc, ORPHAN_SCAN) == []  # in flight: kept
        # A run that died after its request ended (no lease, not in flight) is dropped.
        await redis.zadd(keys.queue(worker.name), {"req-ended:2": 1})
        await redis.set(arq_keys.in_progress("req-ended:2"), 1, ex=3600)
        assert await sweep_orphans(worker.running.wc, ORPHAN_SCAN) == ["req-ended:2"]
        assert not await redis.exists(arq_keys.in_progress("req-ended:2"))
        assert not await redis.exists(keys.lease("req-queued"))
        assert await redis.zcard(keys.queue(worker.name)) == 2  # arq keeps running jobs there
        for rid in ("req-busy", "req-queued"):
            await redis.set(keys.cancel(rid), 1, ex=60)
        busy = await read_stream(redis, "req-busy")
        queued = await read_stream(redis, "req-queued")
    check_stream(busy)
    check_stream(queued)
    assert isinstance(queued[0], Error) and queued[0].kind == "cancelled"


async def test_a_queue_wait_past_the_job_expiry_is_not_a_lost_worker(
    redis: aioredis.Redis, redis_url: str
) -> None:
    """arq drops a job that waited past its expiry; that costs no failover attempt: the request
    is queued again at its place and starts as a first attempt."""
    spec = "scripted:long?rate=600&max_batch=1"  # one slot, busy for a few seconds
    async with running_worker(redis_url, spec, FAST_FAILOVER) as worker:
        assert await submit(redis_url, make_job("req-first", worker.name))
        await read_stream(redis, "req-first", until=2)
        assert await submit(redis_url, make_job("req-waits", worker.name), expires_s=0.5)
        await read_stream(redis, "req-first")
        waited = await read_stream(redis, "req-waits")
    check_stream(waited)
    assert isinstance(waited[0], Start) and waited[0].attempt == 1
    assert isinstance(waited[-1], Finish)
    assert await redis.hget(keys.request("req-waits"), "attempts") is None  # type: ignore[misc]
