"""The worker's ``PublishPipe`` on real Redis: a turn's publishes in one pipeline, each with its
own reply or error, NOSCRIPT recovered, and a real decode loop's steps batched across sequences."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError

from services.worker.loaders import load_model
from services.worker.main import start_worker
from services.worker.publish_pipe import PublishPipe
from services.worker.publisher import Outcome, Publisher
from services.worker.torch_backend import TorchBackend
from shared import keys
from shared.codec import encode_events
from shared.config import Settings
from shared.events import Start, TextDelta
from shared.jobs import GenerateRequest, Message, SamplingParams, TextPart
from shared.protocol import LEASE_LOST, Scripts
from tests.integration.test_worker_bus import read_stream, submit
from tests.invariants import check_stream, generated_token_ids
from tests.job_factory import as_job
from tests.worker_models import write_hf_model

pytestmark = pytest.mark.integration


def call(rid: str, owner: str = "w1") -> tuple[list[str], list[object]]:
    body = encode_events([TextDelta(text=rid, token_ids=[1])])
    return Scripts.publish_call(rid, owner, body, lease_ms=5000, maxlen=100, retention_s=60)


async def test_one_turns_calls_are_one_pipeline_with_their_own_replies(
    redis: aioredis.Redis,
) -> None:
    pipe = PublishPipe(redis, Scripts(redis).publish_source)
    await redis.set(keys.cancel("r1"), 1)  # r1: cancelled; r2: another owner's; r0, r3: plain
    await redis.set(keys.lease("r2"), "w9", px=5000)
    replies = await asyncio.gather(*(pipe.call(*call(f"r{i}")) for i in range(4)))
    assert replies == [0, 1, LEASE_LOST, 0]
    assert pipe.round_trips == 1
    assert [await redis.xlen(keys.events(f"r{i}")) for i in range(4)] == [1, 1, 0, 1]


async def test_noscript_is_resent_whole(redis: aioredis.Redis) -> None:
    pipe = PublishPipe(redis, Scripts(redis).publish_source)
    await redis.script_flush()  # a restarted Redis, or a promoted replica, knows no scripts
    assert await asyncio.gather(pipe.call(*call("a")), pipe.call(*call("b"))) == [0, 0]
    assert pipe.round_trips == 2  # EVALSHA for both, then EVAL for both
    assert await pipe.call(*call("a")) == 0  # loaded now: one EVALSHA
    assert pipe.round_trips == 3 and await redis.xlen(keys.events("a")) == 2


async def test_a_refused_call_fails_alone(redis: aioredis.Redis) -> None:
    pipe = PublishPipe(redis, Scripts(redis).publish_source)
    await redis.set(keys.events("bad"), "not a stream")
    good, bad = await asyncio.gather(
        pipe.call(*call("good")), pipe.call(*call("bad")), return_exceptions=True
    )
    assert good == 0 and isinstance(bad, ResponseError) and "WRONGTYPE" in str(bad)
    assert await redis.xlen(keys.events("good")) == 1


async def test_a_failed_pipeline_fails_every_call() -> None:
    dead = aioredis.Redis(port=1, socket_connect_timeout=0.5)  # nothing listens on port 1
    pipe = PublishPipe(dead, Scripts(dead).publish_source)
    pub = Publisher(dead, "x", "w1", Settings.from_env({}), pipe=pipe)
    results = await asyncio.gather(
        pipe.call(*call("a")), pub.publish([Start(request_id="x", model="m", prompt_tokens=1)]),
        return_exceptions=True,
    )  # fmt: skip
    assert all(isinstance(r, RedisConnectionError) for r in results), results
    await dead.aclose()


async def test_publisher_through_the_pipe_reports_outcomes(redis: aioredis.Redis) -> None:
    pipe = PublishPipe(redis, Scripts(redis).publish_source)
    pub = Publisher(redis, "p", "w1", Settings.from_env({}), pipe=pipe)
    assert await pub.publish([TextDelta(text="a", token_ids=[1])]) is Outcome.OK
    await redis.set(keys.cancel("p"), 1)
    assert await pub.publish([TextDelta(text="b", token_ids=[2])]) is Outcome.CANCELLED


async def test_a_decode_loops_steps_go_out_one_pipeline_each(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    """Eight sequences decoding together: their entries leave in far fewer round trips than
    entries (one per step when the loop hands a step over in one turn). An entry may carry
    several steps (a sequence's batches that wait while the loop is busy are joined), so the
    tokens are counted, not the entries."""
    write_hf_model(tmp_path / "tiny", seed=3)
    loaded = load_model(str(tmp_path / "tiny"), device="cpu")
    backend = TorchBackend(loaded, max_batch=8)
    settings = Settings.from_env({}, redis_url=redis_url, lease_ttl_s=10.0, heartbeat_s=0.5)
    worker = await start_worker(settings, backend)
    try:
        rids = [f"step-{i}" for i in range(8)]
        for i, rid in enumerate(rids):
            request = GenerateRequest(
                request_id=rid,
                model=worker.name,
                messages=[Message(role="user", content=[TextPart(text=f"story {i}")])],
                sampling=SamplingParams(temperature=0.0),
                max_tokens=64,
                ignore_eos=True,
            )
            assert await submit(redis_url, as_job(request, backend))
        for rid in rids:
            events = await read_stream(redis, rid)
            check_stream(events)
            assert len(generated_token_ids(events)) == 64
        entries = sum([await redis.xlen(keys.events(r)) for r in rids])
        assert worker.wc.pipe is not None
        trips = worker.wc.pipe.round_trips
        assert trips * 3 <= entries, (trips, entries)
    finally:
        await worker.stop(0.5)
