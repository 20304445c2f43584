"""Cache-aware pickup with two real workers: a session stays where its history is cached.

Two workers serve the same model (a tiny random Llama, and the real default model in the slow
variant; same weights, so greedy answers agree wherever they run) behind the real API, on the
test Redis. A session of chat turns, each sending back the whole conversation: every turn after
the first runs on the worker that ran the first, as long as that worker has a free slot; when it
is busy the turn goes to the other at once, and when it is killed the other takes it once the
wait is over. Each request's stream ends once, and every turn is answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from services.worker.backend import Backend
from services.worker.loaders import load_model
from services.worker.main import RunningWorker, start_worker
from services.worker.torch_backend import TorchBackend
from shared import keys
from shared.codec import decode_entries
from shared.config import Settings
from tests.integration.server_harness import running_api
from tests.invariants import check_stream
from tests.worker_models import write_hf_model

pytestmark = pytest.mark.integration

TINY = "tiny-affinity"
WAIT_MS = 300  # well inside the holdings' 3 s expiry: a killed worker is still "alive" then
SYSTEM = " ".join(["Paris weather tool call answer question check"] * 12)


@dataclass
class Pair:
    """The API and two workers, "wa" and "wb", each with two slots, serving one model."""

    base: str
    workers: dict[str, RunningWorker]
    model: str
    long_tokens: int  # an answer long enough to still run while a short turn is served


@pytest.fixture(params=["tiny", pytest.param("default", marks=pytest.mark.slow)])
async def pair(
    request: pytest.FixtureRequest, redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> AsyncIterator[Pair]:
    settings = Settings.from_env(
        {}, redis_url=redis_url, lease_ttl_s=10.0, heartbeat_s=0.5, affinity_wait_ms=WAIT_MS,
        device="cpu", threads=1, max_batch=2,
    )  # fmt: skip
    if request.param == "tiny":
        write_hf_model(tmp_path / TINY, seed=3, max_position_embeddings=2048)

    def backend() -> Backend:
        if request.param == "tiny":
            return TorchBackend(load_model(str(tmp_path / TINY), device="cpu"), max_batch=2)
        return TorchBackend.load(settings, "smollm2", None)

    workers: dict[str, RunningWorker] = {}
    try:
        for wid in ("wa", "wb"):
            workers[wid] = await start_worker(settings, backend(), wid=wid)
        async with running_api(settings) as base:
            long_tokens = 1500 if request.param == "tiny" else 300
            yield Pair(base, workers, workers["wa"].name, long_tokens)
    finally:
        for w in workers.values():  # a killed one is gone from the dict
            await w.stop(0.5)


def outcomes(pair: Pair, wid: str) -> dict[str, float]:
    registry = pair.workers[wid].wc.metrics.registry
    return {
        o: registry.get_sample_value(
            "sluice_queue_affinity_pickups_total", {"model": pair.model, "outcome": o}
        )
        or 0.0
        for o in ("hit", "miss", "after_wait", "busy")
    }


async def chat(
    client: httpx.AsyncClient, pair: Pair, messages: list[dict[str, str]], max_tokens: int = 8
) -> dict[str, Any]:
    body = {
        "model": pair.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def turn(client: httpx.AsyncClient, pair: Pair, messages: list[dict[str, str]]) -> str:
    """One turn of the session; returns the worker that served it, once it has published what
    its cache now holds (the tiny model answers within milliseconds: a client could otherwise
    send the next turn before the publish, which a real prompt's reading leaves ample time for)."""
    workers = pair.workers
    before = {wid: w.wc.served for wid, w in workers.items()}
    done = await chat(client, pair, messages)
    messages.append({"role": "assistant", "content": done["choices"][0]["message"]["content"]})
    [served] = [wid for wid, w in workers.items() if w.wc.served > before[wid]]
    holdings = workers[served].consumer.worker.holdings
    assert holdings is not None and holdings.journal is not None
    while holdings.journal:  # noqa: ASYNC110  # the worker's state, no event to wait on
        await asyncio.sleep(0.005)
    published = holdings.publishes
    while holdings.publishes == published:  # noqa: ASYNC110  # one more, with the last entries
        await asyncio.sleep(0.005)
    return served


async def full(redis: aioredis.Redis, pair: Pair, wid: str) -> bool:
    """Whether the worker has published that it has no free slot."""
    field = await redis.hget(keys.affinity_holders(pair.model), wid)  # type: ignore[misc]
    return bool(field) and bytes(field).startswith(b"0 ")


async def every_stream_ended_once(redis: aioredis.Redis, requests: int) -> None:
    """Nothing lost or duplicated: one stream per request, each ending in one terminal event."""
    streams = [k async for k in redis.scan_iter(match=keys.events("*"))]
    assert len(streams) == requests
    for key in streams:
        check_stream(decode_entries(await redis.xrange(key)))


async def session(
    client: httpx.AsyncClient, pair: Pair, turns: int
) -> tuple[list[dict[str, str]], str]:
    """A new session's first ``turns`` turns; all must run on one worker, which it returns."""
    messages = [{"role": "system", "content": SYSTEM}]
    served = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Turn {i}: what next?"})
        served.append(await turn(client, pair, messages))
    assert served == [served[0]] * turns  # later turns went where turn 1's prefix is cached
    assert outcomes(pair, served[0])["hit"] == turns - 1
    return messages, served[0]


async def test_a_busy_worker_is_not_waited_for(pair: Pair, redis: aioredis.Redis) -> None:
    workers = pair.workers
    async with httpx.AsyncClient(base_url=pair.base, timeout=120) as client:
        messages, home = await session(client, pair, 3)
        other = "wb" if home == "wa" else "wa"
        # Two long answers sharing the session's prefix take both of home's slots...
        long_tasks = [
            asyncio.create_task(
                chat(client, pair, [*messages, {"role": "user", "content": ask}], pair.long_tokens)
            )
            for ask in ("Now write a long report.", "And a long summary.")
        ]
        while len(workers[home].wc.active) < 2:  # noqa: ASYNC110  # the worker's state
            await asyncio.sleep(0.01)
        while not await full(redis, pair, home):  # noqa: ASYNC110  # ... and home said so
            await asyncio.sleep(0.01)
        # ... so the next turn goes to the other worker at once, while they still run.
        messages.append({"role": "user", "content": "Turn 3: and then?"})
        assert await turn(client, pair, messages) == other
        assert workers[home].wc.active
        await asyncio.gather(*long_tasks)
    assert outcomes(pair, home)["hit"] == 4  # turns 2 and 3, and the long answers
    assert outcomes(pair, other)["after_wait"] == 0  # taken at once, not after the wait
    await every_stream_ended_once(redis, 6)


async def test_a_killed_worker_is_waited_for_no_longer_than_the_wait(
    pair: Pair, redis: aioredis.Redis
) -> None:
    workers = pair.workers
    async with httpx.AsyncClient(base_url=pair.base, timeout=120) as client:
        messages, home = await session(client, pair, 2)
        other = "wb" if home == "wa" else "wa"
        await workers.pop(home).kill()  # its holdings stay in Redis until they expire
        messages.append({"role": "user", "content": "Turn 2: still there?"})
        assert await turn(client, pair, messages) == other
    assert outcomes(pair, other)["after_wait"] == 1
    await every_stream_ended_once(redis, 3)
