"""What the API knows about served models: their cards, tokenizers, renderers and live workers.

Workers publish a ``ModelCard`` under ``sluice:model:{name}`` and a heartbeat hash under
``sluice:worker:{wid}`` (indexed by ``sluice:workers``, scored by last beat in ms). The cache
builds the ``tokenizers.Tokenizer`` and ``PromptRenderer`` once per card version (the card's
bytes), and re-reads Redis at most every ``refresh_s`` so a request costs no card round trip.
Which models have a live worker is cached the same way, except that a miss is re-checked at
once, so a worker that has just started is usable immediately.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from tokenizers import Tokenizer

from shared import keys
from shared.errors import ModelNotFound
from shared.model_card import ModelCard, decode_card
from shared.prompt import PromptRenderer

__all__ = ["CardCache", "LoadedCard"]


@dataclass
class LoadedCard:
    """A decoded card with its tokenizer and prompt renderer, built once per card version."""

    card: ModelCard
    digest: str
    renderer: PromptRenderer
    fetched: float = 0.0

    @property
    def tokenizer(self) -> Tokenizer:
        """The card's tokenizer (shared with the renderer)."""
        return self.renderer.tokenizer


def _build(card: ModelCard, digest: str, reasoning_when_hidden: bool) -> LoadedCard:
    tokenizer = Tokenizer.from_str(card.tokenizer_json)
    renderer = PromptRenderer(card, tokenizer, reasoning_when_hidden=reasoning_when_hidden)
    return LoadedCard(card=card, digest=digest, renderer=renderer)


class CardCache:
    """Model cards and worker liveness, read from Redis and cached briefly."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        lease_ttl_s: float,
        refresh_s: float = 2.0,
        reasoning_when_hidden: bool = False,
    ) -> None:
        """Create an empty cache.

        Args:
            redis: the app's command client.
            lease_ttl_s: a worker whose last heartbeat is older than this is presumed dead.
            refresh_s: how long a card or the live-model set is trusted before re-reading.
            reasoning_when_hidden: server default passed to every ``PromptRenderer``.
        """
        self._redis = redis
        self._lease_ttl_s = lease_ttl_s
        self._refresh_s = refresh_s
        self._reasoning_when_hidden = reasoning_when_hidden
        self._cards: dict[str, LoadedCard] = {}  # one per published model: bounded by them
        self._building: dict[str, asyncio.Future[LoadedCard]] = {}  # by card digest
        self._live: dict[str, int] = {}
        self._live_at = 0.0
        self._lock = asyncio.Lock()

    async def get(self, model: str) -> LoadedCard:
        """The loaded card of ``model``.

        Args:
            model: the public model id.

        Returns:
            The card with its renderer.

        Raises:
            ModelNotFound: no worker ever published a card for that name.
        """
        now = time.monotonic()
        cached = self._cards.get(model)
        if cached is not None and now - cached.fetched < self._refresh_s:
            return cached
        raw = await self._redis.hget(keys.model_card(model), "card")  # type: ignore[misc]
        if raw is None:
            self._cards.pop(model, None)
            raise ModelNotFound(f"The model '{model}' does not exist", param="model")
        digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
        if cached is None or cached.digest != digest:
            cached = await self._build_once(model, raw, digest)
        cached.fetched = now
        return cached

    async def _build_once(self, model: str, raw: bytes, digest: str) -> LoadedCard:
        """Build a card version's tokenizer and renderer once, however many requests wait.

        Single flight: the first request starts the build (off the loop: a few MB of JSON take
        tens of ms), every concurrent one awaits the same result. Fifty cold requests each
        building their own once took the API from 64 MB to 797 MB of resident memory.
        """
        flight = self._building.get(digest)
        if flight is None:
            build = asyncio.to_thread(_build, decode_card(raw), digest, self._reasoning_when_hidden)
            flight = self._building[digest] = asyncio.ensure_future(build)
            flight.add_done_callback(lambda _: self._building.pop(digest, None))
        loaded = await asyncio.shield(flight)  # one waiter's cancel must not cancel the build
        current = self._cards.get(model)
        if current is None or current.digest != digest:
            self._cards[model] = loaded
        return self._cards[model]

    async def published(self) -> list[str]:
        """Names of every model with a published card (live or not), sorted."""
        names = await self._redis.smembers(keys.models())  # type: ignore[misc]
        return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in names)

    async def cards(self, models: list[str]) -> list[ModelCard]:
        """The cards of ``models`` that still exist, in the given order (no tokenizers built)."""
        if not models:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in models:
                pipe.hget(keys.model_card(name), "card")
            raws = await pipe.execute()
        return [decode_card(raw) for raw in raws if raw is not None]

    async def live_models(
        self, *, fresh: bool = False, not_before_ms: float = 0.0
    ) -> dict[str, int]:
        """Models served by at least one live worker, with the number of such workers.

        Args:
            fresh: bypass the cache.
            not_before_ms: also ignore heartbeats older than this (epoch ms), and workers
                whose last queue poll (the heartbeat's ``polled``) is older; implies fresh and
                leaves the cache alone. A worker too old to report ``polled`` counts by its
                heartbeat alone (a rolling upgrade must not make every probe fail).

        Returns:
            ``{model: live worker count}``.
        """
        if not_before_ms:
            return await self._read_live(not_before_ms)
        now = time.monotonic()
        if not fresh and now - self._live_at < self._refresh_s:
            return self._live
        async with self._lock:
            if not fresh and time.monotonic() - self._live_at < self._refresh_s:
                return self._live
            self._live = await self._read_live()
            self._live_at = time.monotonic()
        return self._live

    async def has_worker(self, model: str) -> bool:
        """Whether a live worker serves ``model`` (a cached miss is re-checked at once)."""
        if model in await self.live_models():
            return True
        return model in await self.live_models(fresh=True)

    async def _read_live(self, not_before_ms: float = 0.0) -> dict[str, int]:
        cutoff = int(max((time.time() - self._lease_ttl_s) * 1000, not_before_ms))
        wids = await self._redis.zrangebyscore(keys.workers(), cutoff, "+inf")
        if not wids:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for wid in wids:
                worker_id = wid.decode() if isinstance(wid, bytes) else wid
                pipe.hmget(keys.worker(worker_id), ["model", "polled"])
            fields = await pipe.execute()
        live: dict[str, int] = {}
        for model, polled in fields:
            if not_before_ms and polled is not None and int(polled) < not_before_ms:
                continue  # heartbeats resumed, but its queue poll has not yet
            if model is not None:  # the hash expired: that worker is gone despite its score
                name = model.decode() if isinstance(model, bytes) else str(model)
                live[name] = live.get(name, 0) + 1
        return live
