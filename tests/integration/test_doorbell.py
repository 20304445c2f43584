"""The cluster doorbell (``shared.protocol.ringing``) on a real Redis: every append rings.

Sharded pub/sub works on a single Redis 7 too, so the scripts as a cluster runs them are checked
here against the test Redis: a publish rings whether or not the cancel flag is set (a script
that returned early after its XADD once skipped the bell, and a cancelled request's last
entries then waited for the hub's periodic sweep).
"""

from __future__ import annotations

import time

import pytest
import redis

from shared import keys
from shared.codec import SCHEMA_VERSION, encode_events
from shared.events import TextDelta
from shared.protocol import PUBLISH, ringing

pytestmark = pytest.mark.integration

RID = "req-doorbell"


def _rings(r: redis.Redis, pubsub: redis.client.PubSub) -> bytes | None:
    publish = r.register_script(ringing(PUBLISH))
    body = encode_events([TextDelta(text="x")])
    args = ["w1", 3000, 1000, 0, SCHEMA_VERSION, body]
    publish(keys=[keys.events(RID), keys.lease(RID), keys.cancel(RID)], args=args)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        message = pubsub.get_sharded_message(timeout=0.1)
        if message and message["type"] == "smessage":
            data: bytes = message["data"]
            return data
    return None


@pytest.mark.parametrize("cancelled", [False, True], ids=["running", "cancelled"])
def test_every_publish_rings_the_doorbell(redis_url: str, cancelled: bool) -> None:
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    if cancelled:
        r.set(keys.cancel(RID), "1")
    pubsub = r.pubsub()
    pubsub.ssubscribe(keys.events(RID))
    try:
        rung = _rings(r, pubsub)
        newest = r.xrevrange(keys.events(RID), count=1)[0][0]
        assert rung == newest
    finally:
        pubsub.close()
        r.close()
