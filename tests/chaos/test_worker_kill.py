"""A worker SIGKILLed with a full batch in flight: every answer completes exactly on a peer,
the queue holds nothing of the dead runs afterwards, and new requests start at once."""

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


def _body(max_tokens: int, stream: bool = True) -> dict[str, object]:
    return chat_body(LONG_MODEL, max_tokens, stream)


IN_FLIGHT = 16


async def test_kill_9_with_a_full_batch(stack: Callable[..., Stack]) -> None:
    s = stack(workers=1)
    victim = s.workers[0]
    started = 0
    all_started = asyncio.Event()

    def one_more() -> None:
        nonlocal started
        started += 1
        if started == IN_FLIGHT:
            all_started.set()

    async with httpx.AsyncClient(timeout=120) as client:
        reference = await client.post(f"{s.base}/v1/chat/completions", json=_body(150, False))
        expected = reference.json()["choices"][0]["message"]["content"]
        s.start_worker()
        wait_http(f"{s.base}/readyz")
        idle_before = await _commands_per_s(s)
        streams = [
            asyncio.create_task(
                read_chat(client, s.base, _body(150), after_chunks=3, hook=one_more)
            )
            for _ in range(IN_FLIGHT)
        ]
        await asyncio.wait_for(all_started.wait(), 60)
        victim.kill()
        killed = time.monotonic()
        # A fresh request is served at once: the dead runs do not block the queue.
        fresh = await read_chat(client, s.base, _body(5))
        assert fresh.done and fresh.error is None
        assert fresh.ended_at - killed < 5.0  # 2 s on an idle machine; margin for a busy CI
        results = await asyncio.gather(*streams)
        r = s.redis.client()
        assert [g.text for g in results] == [expected] * IN_FLIGHT, s.logs()
        assert all(g.error is None and g.finish_reason == "length" for g in results)
        # Nothing of the dead runs is left in arq's keys once the sweepers have passed.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            leftovers = r.zcard(f"sluice:queue:{LONG_MODEL}"), len(r.keys("arq:in-progress:*"))
            if leftovers == (0, 0):
                break
            await asyncio.sleep(0.2)
        assert leftovers == (0, 0), r.zrange(f"sluice:queue:{LONG_MODEL}", 0, -1)
        # Idle Redis load is back to what two idle workers cost (a dead worker's jobs once
        # kept the survivor polling them: ~16 -> ~6,000 commands/s).
        idle_after = await _commands_per_s(s)
        assert idle_after <= 3 * idle_before + 50, (idle_before, idle_after)
    wait_http(f"{s.base}/readyz")


async def _commands_per_s(s: Stack, window_s: float = 1.0) -> float:
    """Commands Redis processed per second over ``window_s`` (INFO's counter, our two calls out)."""
    r = s.redis.client()
    first = int(r.info("stats")["total_commands_processed"])
    await asyncio.sleep(window_s)
    last = int(r.info("stats")["total_commands_processed"])
    return (last - first - 1) / window_s
