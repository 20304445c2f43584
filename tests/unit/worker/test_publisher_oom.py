"""A full Redis (``maxmemory``, ``noeviction``) refusing a publish: the batch is held and sent
again until it lands, once; past ``SLUICE_OOM_WAIT_S`` one retryable Error ends the stream.

fakeredis cannot run out of memory, so the refusal is redis-py's own exception raised by a stub
in front of the real script, on the real Redis the other publisher tests use."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ResponseError

from services.redis_oom import OOM_MESSAGE, is_oom
from services.worker import publisher as publisher_module
from services.worker.publisher import Outcome, Publisher
from shared import keys
from shared.codec import decode_entry
from shared.config import Settings
from shared.events import AnyEvent, Error, Finish, Start, TextDelta

pytestmark = pytest.mark.integration

RID = "req-oom"
REFUSAL = "OOM command not allowed when used memory > 'maxmemory'. script: 0123abcd"


async def events(redis: aioredis.Redis) -> list[AnyEvent]:
    return [e for _, f in await redis.xrange(keys.events(RID)) for e in decode_entry(f)]


def refusing(pub: Publisher, times: int, exc: Exception) -> list[int]:
    """Make the publisher's script refuse ``times`` calls, then run; returns the call count."""
    calls = [0]
    real = pub._scripts.publish

    async def publish(keys_: list[str], args: list[Any]) -> int:
        calls[0] += 1
        if calls[0] <= times:
            raise exc
        return await real(keys_, args)

    pub._scripts.publish = publish  # type: ignore[method-assign]
    return calls


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publisher_module, "_FIRST_PAUSE_S", 0.0)
    monkeypatch.setattr(publisher_module, "_MAX_PAUSE_S", 0.0)


def test_the_refusal_is_recognised_in_every_shape() -> None:
    assert is_oom(OutOfMemoryError(REFUSAL))
    assert is_oom(ResponseError("Error running script (call to f_0123): -OOM command not allowed"))
    assert not is_oom(ResponseError("WRONGTYPE Operation against a key"))
    assert not is_oom(ValueError("OOM command not allowed"))


async def test_a_refused_batch_is_held_and_lands_once(redis: aioredis.Redis) -> None:
    pub = Publisher(redis, RID, "w1", Settings.from_env({}))
    calls = refusing(pub, 5, OutOfMemoryError(REFUSAL))
    batch = [Start(request_id=RID, model="m", prompt_tokens=1), TextDelta(text="hi")]
    assert await pub.publish(batch) is Outcome.OK
    assert calls[0] == 6
    assert await pub.publish([Finish(reason="end_turn")]) is Outcome.OK
    assert [type(e) for e in await events(redis)] == [Start, TextDelta, Finish]


async def test_past_the_wait_one_retryable_error_ends_it(redis: aioredis.Redis) -> None:
    pub = Publisher(redis, RID, "w1", Settings.from_env({}, oom_wait_s=0))
    refusing(pub, 10**6, ResponseError(f"ERR Error running script: -{REFUSAL}"))
    assert await pub.publish([TextDelta(text="held")]) is Outcome.OK
    written = await events(redis)
    assert written == [Error(kind="overloaded", message=OOM_MESSAGE, retryable=True)]
    assert pub.terminal == written[0]
    assert not await pub.ensure_terminal(lambda: [Finish(reason="end_turn")])  # still only one


async def test_a_held_final_batch_is_written_whole(redis: aioredis.Redis) -> None:
    pub = Publisher(redis, RID, "w1", Settings.from_env({}, oom_wait_s=0))
    refusing(pub, 10**6, OutOfMemoryError(REFUSAL))
    await pub.publish([TextDelta(text="last"), Finish(reason="end_turn")])
    assert [type(e) for e in await events(redis)] == [TextDelta, Finish]


async def test_other_redis_errors_are_not_retried(redis: aioredis.Redis) -> None:
    pub = Publisher(redis, RID, "w1", Settings.from_env({}))
    calls = refusing(pub, 1, ResponseError("WRONGTYPE Operation against a key"))
    with pytest.raises(ResponseError):
        await pub.publish([TextDelta(text="x")])
    assert calls[0] == 1
