"""Two Redis servers: the event log on one (``SLUICE_EVENTS_URL``), arq's queue on another
(``SLUICE_QUEUE_URL``), and ``SLUICE_REDIS_URL`` pointing at nothing.

The events side is the test database; the queue side is a private redis-server on a unix
socket of this test's own. A request must go the whole way (admission, enqueue, pickup,
generation, streaming) with each kind of key on its own server.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from services.queue import arq_keys
from services.redis_local import PrivateRedis, find_redis_server, start_private_redis
from shared import keys
from shared.config import Settings
from shared.events import AnyEvent, Finish, TextDelta
from tests.integration.server_harness import running_api
from tests.integration.test_api_native import sse_events
from tests.integration.worker_harness import running_worker
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

_EVENT = msgspec.json.Decoder(AnyEvent)
NOWHERE = "redis://127.0.0.1:1/0"  # nothing listens on port 1: any use of it fails loudly


@pytest.fixture
def queue_redis() -> Iterator[PrivateRedis]:
    found = find_redis_server()
    if found is None:
        pytest.fail("no redis-server on PATH for the queue side")
    # A short directory: unix socket paths are limited to ~107 bytes.
    with tempfile.TemporaryDirectory(prefix="sq-") as run_dir:
        server = start_private_redis(found[0], Path(run_dir))
        try:
            yield server
        finally:
            server.stop()


async def test_events_and_queue_on_separate_servers(
    redis: aioredis.Redis, redis_url: str, queue_redis: PrivateRedis
) -> None:
    split = {"events_url": redis_url, "queue_url": queue_redis.url}
    settings = Settings(
        redis_url=NOWHERE,
        events_url=redis_url,
        queue_url=queue_redis.url,
        keepalive_s=0.5,
        heartbeat_s=0.2,
    )
    queue = aioredis.Redis.from_url(queue_redis.url)
    try:
        async with (
            running_worker(NOWHERE, "scripted:text?rate=0", split) as worker,
            running_api(settings) as api,
            httpx.AsyncClient(base_url=api, timeout=20) as client,
        ):
            body = {
                "model": worker.name,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            }
            created = await client.post("/v1/requests", json=body)
            assert created.status_code == 200, created.text
            rid = created.json()["id"]
            received: list[AnyEvent] = []
            async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
                async for frame in sse_events(response):
                    if "comment" not in frame:
                        received.append(_EVENT.decode(frame["data"]))
        check_stream(received)
        assert isinstance(received[-1], Finish) and received[-1].reason == "end_turn"
        assert "".join(e.text for e in received if isinstance(e, TextDelta))
        # The log, the request hash and the card are on the events server ...
        assert await redis.exists(keys.events(rid), keys.request(rid)) == 2
        assert await redis.exists(keys.model_card(worker.name)) == 1
        # ... and nothing of arq's is: its enqueue script and pickup ran on the queue server.
        arq_prefixes = (arq_keys.job(""), arq_keys.in_progress(""), arq_keys.result(""))
        events_side = [k.decode() for k in await redis.keys("*")]
        assert keys.queue(worker.name) not in events_side
        assert not [k for k in events_side if k.startswith(arq_prefixes)]
        queue_side = [k.decode() for k in await queue.keys("*")]
        assert keys.events(rid) not in queue_side and keys.request(rid) not in queue_side
        stats = await queue.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] >= 1  # the bounded enqueue
        assert stats["cmdstat_zrangebyscore"]["calls"] >= 1  # arq's poll
    finally:
        await queue.aclose()
