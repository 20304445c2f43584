"""The cluster hub on a real local cluster: subscriptions that arrive while it is mid-pass."""

from __future__ import annotations

import asyncio

import pytest

from services import redis_conn
from services.api.cluster_hub import ClusterStreamHub
from shared import keys
from tests.cluster.nodes import LocalCluster

pytestmark = pytest.mark.integration


async def test_subscriptions_joining_during_a_pass_are_all_served(
    local_cluster: LocalCluster,
) -> None:
    """Clients connect one by one while the hub's pass awaits a node (opening its reader,
    sending SSUBSCRIBE): the pass once iterated the live subscription map across those awaits,
    died with 'dictionary changed size during iteration', and no stream was served again."""
    local_cluster.revive()
    local_cluster.flush()
    redis = redis_conn.client(local_cluster.url)
    hub = ClusterStreamHub(local_cluster.url, redis)
    await hub.start()
    try:
        stream_keys = [keys.events(f"req_join_{i:03d}") for i in range(40)]
        for key in stream_keys:
            await redis.xadd(key, {b"v": b"2", b"e": b"x"})
        subs = []
        for key in stream_keys:  # spread over the pass's awaits, as sequential connects are
            subs.append(await hub.subscribe(key))
            await asyncio.sleep(0.001)
        for sub in subs:  # sooner than the hub's 5 s sweep: read on its confirmation
            assert await sub.get(wait_s=3) is not None, sub.key
        assert hub._task is not None and not hub._task.done()
    finally:
        await hub.stop()
        await redis.aclose()
