"""A 500 leaves the keep-alive connection usable: the next request on it gets a normal answer.

Starlette re-raises an unhandled error after sending the 500, and uvicorn closed the connection
on it, so a client's next request on the same pooled connection read a reset.
"""

from __future__ import annotations

import httpx
import pytest

from services.api.cards import CardCache

pytestmark = pytest.mark.integration


async def test_next_request_on_the_connection_after_a_500_is_answered(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = CardCache.live_models

    async def broken(self: CardCache, *args: object, **kwargs: object) -> object:
        raise RuntimeError("a bug in a handler's dependency")

    # One connection, so the second request must reuse the first one's socket.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=api, limits=limits, timeout=10) as client:
        monkeypatch.setattr(CardCache, "live_models", broken)
        failed = await client.get("/v1/models")
        monkeypatch.setattr(CardCache, "live_models", real)
        answered = await client.get("/v1/models")
        again = await client.post("/v1/chat/completions", content=b"{")
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "internal"
    assert answered.status_code == 200 and answered.json()["object"] == "list"
    assert again.status_code == 400  # still the same connection, still answering
