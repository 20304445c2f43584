"""The card cache builds a model's tokenizer and renderer once, however many requests ask."""

from __future__ import annotations

import asyncio

import fakeredis

from services.api.cards import CardCache
from tests.integration.server_harness import publish_card, tiny_card


async def test_concurrent_first_requests_share_one_build() -> None:
    redis = fakeredis.FakeAsyncRedis()
    card = tiny_card()
    await publish_card(redis, card)
    cache = CardCache(redis, lease_ttl_s=5.0)
    loaded = await asyncio.gather(*(cache.get(card.name) for _ in range(50)))
    assert len({id(one) for one in loaded}) == 1  # one tokenizer, not fifty
    assert {id(one.tokenizer) for one in loaded} == {id(loaded[0].tokenizer)}
    assert await cache.get(card.name) is loaded[0]  # and it stays cached
