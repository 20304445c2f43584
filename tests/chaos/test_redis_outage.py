"""Redis dies under a running service: nobody exits, no client hangs, nothing is made up.

Real processes throughout: a private redis-server killed with SIGKILL and restarted with and
without its append-only file, ``sluice worker`` (scripted backend, exact text) and ``sluice api``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from tests.chaos.conftest import LONG_MODEL, Stack
from tests.chaos.procs import wait_http
from tests.chaos.sse_reader import chat_body, read_chat

pytestmark = pytest.mark.integration


def _body(max_tokens: int = 120, stream: bool = True) -> dict[str, object]:
    return chat_body(LONG_MODEL, max_tokens, stream)


# The lease TTL (1.5 s) plus the stream watch's margin (1 s) plus slack for a loaded CI box.
NO_HANG_S = 1.5 + 1.0 + 6.0


async def test_worker_and_api_ride_out_a_redis_restart_without_data(
    stack: Callable[..., Stack],
) -> None:
    s = stack(aof=False)
    s.redis.kill()
    async with httpx.AsyncClient(timeout=30) as client:
        # While Redis is down: a 503 the client can retry, not a 500.
        await asyncio.sleep(1.5)  # several failed polls and heartbeats
        down = await client.post(f"{s.base}/v1/chat/completions", json=_body(stream=False))
        assert down.status_code == 503, down.text
        assert down.headers.get("retry-after") == "1"
        assert (await client.get(f"{s.base}/readyz")).status_code == 503
        assert s.workers[0].alive(), s.logs()
        s.redis.start()  # empty: the card, the heartbeat and the queue are gone
        wait_http(f"{s.base}/readyz", timeout_s=20)
        reply = await client.post(f"{s.base}/v1/chat/completions", json=_body(8, stream=False))
        assert reply.status_code == 200, reply.text + s.logs()
        assert reply.json()["choices"][0]["message"]["content"].startswith("w0 w1 w2")
    assert s.workers[0].alive() and s.api is not None and s.api.alive()


@pytest.mark.parametrize("aof", [True, False], ids=["aof", "no-aof"])
async def test_a_stream_across_a_redis_restart_ends(stack: Callable[..., Stack], aof: bool) -> None:
    """With AOF the answer completes exactly; without, a retryable error ends it in time."""
    s = stack(aof=aof)
    restarted: list[float] = []

    def outage() -> None:
        s.redis.kill()
        time.sleep(0.8)
        s.redis.start()
        restarted.append(time.monotonic())

    async with httpx.AsyncClient(timeout=60) as client:
        got = await read_chat(client, s.base, _body(), after_chunks=5, hook=outage)
        assert restarted, "the stream ended before the outage"
        waited = got.ended_at - restarted[0]
        assert got.done, got.frames[-3:]
        assert waited < NO_HANG_S, (waited, s.logs())
        if aof:
            assert got.error is None, (got.error, s.logs())
            again = await client.post(f"{s.base}/v1/chat/completions", json=_body(stream=False))
            assert got.text == again.json()["choices"][0]["message"]["content"]
            assert got.finish_reason == "length"
        else:
            assert got.error is not None and got.error["code"] == "worker_lost", got.frames[-3:]


async def test_readyz_ignores_heartbeats_restored_from_the_aof(stack: Callable[..., Stack]) -> None:
    s = stack(aof=True)
    s.workers[0].kill()
    s.redis.kill()  # the last heartbeat, a moment old, is in the AOF
    s.redis.start()
    async with httpx.AsyncClient(timeout=10) as client:
        ready = await client.get(f"{s.base}/readyz")
        assert ready.status_code == 503, ready.text
        s.start_worker()
    wait_http(f"{s.base}/readyz", timeout_s=20)


async def test_a_worker_started_before_redis_waits_for_it(stack: Callable[..., Stack]) -> None:
    s = stack(aof=False, workers=0)
    s.redis.kill()
    early = s.start_worker()  # Redis is down: it must wait, not exit
    await asyncio.sleep(2.0)  # several start-up attempts
    assert early.alive(), s.logs()
    s.redis.start()
    wait_http(f"{s.base}/readyz", timeout_s=20)
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{s.base}/v1/chat/completions", json=_body(8, stream=False))
    assert reply.status_code == 200, reply.text + s.logs()
    assert reply.json()["choices"][0]["message"]["content"].startswith("w0 w1 w2")
    assert "cannot reach Redis" in early.output()


def test_a_worker_waiting_for_redis_stops_on_sigterm(stack: Callable[..., Stack]) -> None:
    s = stack(aof=False, workers=0)
    s.redis.kill()
    waiting = s.start_worker()
    time.sleep(1.0)
    assert waiting.alive(), s.logs()
    waiting.stop()
    assert waiting.proc.returncode == 0, s.logs()
