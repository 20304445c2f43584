"""A Redis restart: the worker's queue poll resumes at once, and /readyz waits for it.

Redis (with its append-only file, so the old heartbeats come back) is restarted right after a
failed queue poll, the worst moment for a backoff: the whole delay lies ahead. The test then
watches /readyz and sends a request at once, against the worker's own log of its recovery.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from datetime import datetime

import httpx
import pytest

from tests.chaos.conftest import LONG_MODEL, Stack
from tests.chaos.sse_reader import chat_body

pytestmark = pytest.mark.integration

# Redis answering -> the request's reply: the poll's longest backoff gap (0.5 s), its pickup and
# a few tokens, with room for a loaded box. Before the fix the gap alone was 2 s.
REPLY_WITHIN_S = 1.5
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*queue poll recovered", re.M)


def _recovered_at(log: str) -> float:
    """Epoch seconds of the worker's last "queue poll recovered" line."""
    stamps = _STAMP.findall(log)
    assert stamps, log[-3000:]
    return datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def _wait_for_failed_poll(s: Stack, after: int) -> None:
    for _ in range(1000):
        if "queue poll failed" in s.workers[0].output()[after:]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(s.logs())


async def test_a_worker_polls_within_a_second_of_redis_restarting(
    stack: Callable[..., Stack],
) -> None:
    s = stack(aof=True, SLUICE_LOG_LEVEL="debug")  # each failed poll
    s.redis.kill()
    await asyncio.sleep(3.5)  # past the point where the old backoff reached its 2 s cap
    await _wait_for_failed_poll(s, len(s.workers[0].output()))
    s.redis.start()  # returns once Redis answers PING
    back = time.monotonic()
    probes: list[tuple[float, int]] = []  # (epoch s, /readyz status)

    async def probe(client: httpx.AsyncClient) -> None:
        while time.monotonic() - back < 4.0:
            answer = await client.get(f"{s.base}/readyz")
            probes.append((time.time(), answer.status_code))
            await asyncio.sleep(0.02)

    async with httpx.AsyncClient(timeout=30) as client:
        watching = asyncio.create_task(probe(client))
        body = chat_body(LONG_MODEL, 8, False)
        while True:  # 503 until the worker's first heartbeat: a client retries it
            reply = await client.post(f"{s.base}/v1/chat/completions", json=body)
            if reply.status_code != 503 or time.monotonic() - back > 10:
                break
            await asyncio.sleep(0.02)
        took = time.monotonic() - back
        await watching
    assert reply.status_code == 200, reply.text + s.logs()
    assert reply.json()["choices"][0]["message"]["content"].startswith("w0 w1 w2")
    assert took < REPLY_WITHIN_S, (took, s.logs())
    recovered = _recovered_at(s.workers[0].output())
    ready = [at for at, status in probes if status == 200]
    assert ready, (probes, s.logs())
    # The log's stamp is truncated to the ms, and /readyz's time is taken after its answer.
    assert ready[0] >= recovered - 0.002, (ready[0] - recovered, probes, s.logs())
