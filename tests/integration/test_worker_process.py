"""``sluice worker`` as a real process: start-up failures, serving, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
import redis.asyncio as aioredis

from shared import keys
from tests.integration.test_worker_bus import make_job, read_stream, submit
from tests.invariants import check_stream

pytestmark = pytest.mark.integration


async def spawn(redis_url: str, model: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "SLUICE_REDIS_URL": redis_url, "SLUICE_HEARTBEAT_S": "0.2"}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "worker", "--model", model,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def test_unknown_model_is_one_line_and_exit_2(redis_url: str) -> None:
    proc = await spawn(redis_url, "scripted:no-such-scenario")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "no-such-scenario" in lines[0]


async def test_serves_then_stops_on_sigterm(redis: aioredis.Redis, redis_url: str) -> None:
    proc = await spawn(redis_url, "scripted:echo?rate=0")
    try:
        for _ in range(1200):  # the card appears once the worker is up
            if await redis.sismember(keys.models(), "scripted-echo"):  # type: ignore[misc]
                break
            await asyncio.sleep(0.05)
        assert await submit(redis_url, make_job("req-proc", "scripted-echo", text="one two"))
        events = await read_stream(redis, "req-proc")
        check_stream(events)
        assert await redis.zcard(keys.workers()) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    assert await redis.zcard(keys.workers()) == 0
