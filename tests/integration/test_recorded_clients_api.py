"""The recorded Codex and Claude Code request bodies, replayed through the live API.

Real uvicorn, real Redis and a scripted worker whose card holds the prompts (byte-level tokens:
one per byte). Each body goes in exactly as the program sent it, with only ``model`` swapped.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tests.integration.worker_harness import WorkerHandle, running_worker

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parents[1] / "fixtures" / "clients"
CONTEXT = 120_000
ANTHROPIC_OVERFLOW = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), "
    r"decrease input length or `max_tokens` and try again"
)


@pytest.fixture
async def worker(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[WorkerHandle]:
    async with running_worker(redis_url, f"scripted:text?rate=0&ctx={CONTEXT}") as handle:
        yield handle


def _body(name: str, model: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return {**body, "model": model}


async def _events(response: httpx.Response) -> list[str]:
    return [
        line.removeprefix("event: ")
        async for line in response.aiter_lines()
        if line.startswith("event: ")
    ]


@pytest.mark.parametrize(
    "name", ["codex-0.169.0-responses.json", "codex-0.169.0-responses-unknown-model.json"]
)
async def test_codex_requests_stream_to_completion(
    api: str, worker: WorkerHandle, name: str
) -> None:
    body = _body(name, worker.name)
    async with (
        httpx.AsyncClient(base_url=api, timeout=60) as client,
        client.stream("POST", "/v1/responses", json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        assert response.headers["x-sluice-ignored-tools"] == "web_search"
        events = await _events(response)
    assert events[0] == "response.created" and events[-1] == "response.completed", events


@pytest.mark.parametrize(
    "name",
    [
        "claude-code-2.1.332-messages.json",
        "claude-code-2.1.332-messages-full-tools.json",
        # thinking: enabled with display "updates", which sluice once refused (issue 28)
        "claude-code-2.1.332-messages-thinking-updates.json",
    ],
)
async def test_claude_code_requests_get_anthropics_overflow_then_stream(
    api: str, worker: WorkerHandle, name: str
) -> None:
    body = _body(name, worker.name)
    async with httpx.AsyncClient(base_url=api, timeout=60) as client:
        refused = await client.post("/v1/messages?beta=true", json={**body, "max_tokens": CONTEXT})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error"
        match = ANTHROPIC_OVERFLOW.fullmatch(error["message"])
        assert match is not None, error
        prompt, asked, limit = (int(g) for g in match.groups())
        assert (asked, limit) == (CONTEXT, CONTEXT) and prompt > 10_000
        retry = {**body, "max_tokens": limit - prompt}  # what Claude Code does with the numbers
        async with client.stream("POST", "/v1/messages?beta=true", json=retry) as response:
            assert response.status_code == 200, await response.aread()
            ignored = response.headers["x-sluice-ignored-fields"].split(",")
            events = await _events(response)
    assert ignored[0] == "context_management"
    assert ("thinking.display" in ignored) == ("updates" in name), ignored
    assert events[0] == "message_start" and events[-1] == "message_stop", events
