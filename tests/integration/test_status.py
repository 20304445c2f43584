"""``sluice status`` against a live cluster: two real workers, two running requests, one queued.

The command runs as the operator runs it (a subprocess of the real CLI, reading only Redis).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.config import Settings
from tests.integration.server_harness import running_api
from tests.integration.worker_harness import running_worker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def sluice(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLUICE_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def status_json(redis_url: str) -> dict[str, Any]:
    out = await asyncio.to_thread(sluice, redis_url, "status", "--json")
    assert out.returncode == 0, out.stderr
    parsed: dict[str, Any] = json.loads(out.stdout)
    return parsed


def native(model: str) -> dict[str, object]:
    content = [{"type": "text", "text": "hello"}]
    return {"model": model, "messages": [{"role": "user", "content": content}]}


async def test_status_json_shows_two_workers_and_a_queued_request(
    settings: Settings, redis: aioredis.Redis, redis_url: str
) -> None:
    # One slot each and a long, slow answer: two requests run, the third must wait in the queue.
    spec = "scripted:long?rate=20&max_batch=1"
    async with (
        running_api(settings) as api,
        running_worker(redis_url, spec, name="slow", wid="status-w1"),
        running_worker(redis_url, spec, name="slow", wid="status-w2"),
        httpx.AsyncClient(base_url=api, timeout=30) as client,
    ):
        rids = []
        for _ in range(3):
            created = await client.post("/v1/requests", json=native("slow"))
            assert created.status_code == 200, created.text
            rids.append(created.json()["id"])
        deadline = time.monotonic() + 30
        while True:  # until both workers report their slot busy in a heartbeat
            snap = await status_json(redis_url)
            busy = [w["slots_busy"] for w in snap["workers"]]
            if busy == [1, 1]:
                break
            assert time.monotonic() < deadline, snap
            await asyncio.sleep(0.2)

        assert sorted(w["id"] for w in snap["workers"]) == ["status-w1", "status-w2"]
        for w in snap["workers"]:
            assert w["model"] == "slow"
            assert w["slots_total"] == 1
            assert w["device"] == "none"  # the scripted double has no device
            assert 0 <= w["heartbeat_age_s"] < 10
        [model] = snap["models"]
        assert model["name"] == "slow"
        assert model["workers"] == 2
        assert model["queued"] == 1
        assert model["oldest_wait_s"] >= 0
        assert model["in_flight"] == 3
        assert snap["in_flight"] == 3
        assert await redis.zcard(keys.queue("slow")) == 3  # arq keeps running jobs there too

        text = await asyncio.to_thread(sluice, redis_url, "status")
        assert text.returncode == 0, text.stderr
        assert "status-w1" in text.stdout and "status-w2" in text.stdout
        for rid in rids:
            await client.post(f"/v1/requests/{rid}/cancel")
