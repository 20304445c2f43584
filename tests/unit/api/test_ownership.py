"""One ownership rule: a stored request or response is its creator's; to any other key, 404."""

from __future__ import annotations

from typing import cast

import fakeredis
import msgspec
import pytest

from services.api import responses_store
from services.api.ownership import REQUESTS, RETRIEVABLE, load_owned
from services.api.state import AppState
from shared import keys
from shared.codec import encode_job
from shared.errors import NotFound
from shared.jobs import Job, Message, TextPart
from tests.golden.test_openai_responses import golden_skeleton

RID = "req_0001"
JOB = Job(
    request_id=RID,
    model="tiny-test",
    messages=[Message(role="user", content=[TextPart("hi")])],
    owner="a",
    prompt_token_ids=[1, 2, 3],
    prompt_text="hi",
)


async def _state(data: dict[str, dict[str, bytes] | bytes]) -> AppState:
    """An app state whose Redis is an in-process fakeredis holding ``data``."""
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    for key, value in data.items():
        if isinstance(value, dict):
            await redis.hset(key, mapping=value)
        else:
            await redis.set(key, value)
    return cast(AppState, type("State", (), {"redis": redis})())


async def test_the_owner_loads_its_request() -> None:
    state = await _state({keys.request(RID): {"owner": b"a", "job": encode_job(JOB)}})
    assert await load_owned(state, REQUESTS, RID, "a") == JOB


@pytest.mark.parametrize("owner", ["b", ""])
async def test_another_key_and_a_missing_request_get_the_same_404(owner: str) -> None:
    state = await _state({keys.request(RID): {"owner": b"a", "job": encode_job(JOB)}})
    with pytest.raises(NotFound) as other:
        await load_owned(state, REQUESTS, RID, owner)
    with pytest.raises(NotFound) as missing:
        await load_owned(state, REQUESTS, "req_missing", "a")
    assert other.value.http_status == missing.value.http_status == 404
    assert other.value.message == f"no request with id '{RID}'"


async def test_stored_responses_follow_the_same_rule() -> None:
    skeleton = golden_skeleton()
    record = responses_store.StoredResponse(owner="a", skeleton=skeleton)
    state = await _state({keys.response(skeleton.id): msgspec.json.encode(record)})
    loaded = await load_owned(state, responses_store.RESPONSES, skeleton.id, "a")
    assert loaded.skeleton == skeleton
    with pytest.raises(NotFound) as other:
        await load_owned(state, responses_store.RESPONSES, skeleton.id, "b")
    assert other.value.param == "response_id"


async def test_an_unstored_request_is_missing_to_retrieve_but_not_to_resume() -> None:
    unstored = msgspec.structs.replace(JOB, store=False)
    state = await _state({keys.request(RID): {"owner": b"a", "job": encode_job(unstored)}})
    assert await load_owned(state, REQUESTS, RID, "a") == unstored  # the events routes
    with pytest.raises(NotFound) as info:
        await load_owned(state, RETRIEVABLE, RID, "a")
    assert info.value.message == f"no request with id '{RID}'"  # as if it never existed
    stored = await _state({keys.request(RID): {"owner": b"a", "job": encode_job(JOB)}})
    assert await load_owned(stored, RETRIEVABLE, RID, "a") == JOB
