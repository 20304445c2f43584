"""Failures on a Redis Cluster: a worker killed mid-stream, a second API process, cancel by id,
and the primary that holds a streaming request's slot killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import pytest

from tests.chaos.sse_reader import chat_body, read_chat
from tests.cluster.conftest import MODEL, Stack

pytestmark = pytest.mark.integration


def _chat(max_tokens: int, stream: bool = True) -> dict[str, object]:
    return chat_body(MODEL, max_tokens, stream)


def _native(max_tokens: int) -> dict[str, object]:
    content = [{"type": "text", "text": "go"}]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }


async def test_worker_failover_responses_and_cancel(cluster_stack: Callable[..., Stack]) -> None:
    s = cluster_stack(workers=1, apis=2)
    other = s.apis[1][1]
    async with httpx.AsyncClient(timeout=60) as client:
        reference = await client.post(f"{s.base}/v1/chat/completions", json=_chat(120, False))
        expected = reference.json()["choices"][0]["message"]["content"]
        # A Responses object stored through one API process, read through the other.
        body = {"model": MODEL, "input": "go", "max_output_tokens": 20}
        made = await client.post(f"{s.base}/v1/responses", json=body)
        assert made.status_code == 200, made.text + s.logs()
        read = await client.get(f"{other}/v1/responses/{made.json()['id']}")
        assert read.status_code == 200 and read.json()["output"] == made.json()["output"]
        # The worker dies mid-stream; a second one continues it on the other API's stream.
        victim = s.workers[0]
        s.start_worker()
        got = await read_chat(client, other, _chat(120), after_chunks=5, hook=victim.kill)
        assert got.error is None and got.text == expected, s.logs()
        # Cancel by id through one process while the other streams it.
        job = await client.post(f"{s.base}/v1/requests", json=_native(4000))
        assert job.status_code == 200, job.text
        rid = job.json()["id"]
        await asyncio.sleep(0.5)
        cancelled = await client.post(f"{other}/v1/requests/{rid}/cancel")
        assert cancelled.status_code == 200
        final = await client.get(f"{s.base}/v1/chat/completions/{rid}")
        assert final.json()["choices"][0]["finish_reason"] in ("stop", "cancelled", "length")
        assert len(final.json()["choices"][0]["message"]["content"].split()) < 4000


async def test_killed_primary_of_the_streams_slot(cluster_stack: Callable[..., Stack]) -> None:
    s = cluster_stack(workers=1)
    killed: list[int] = []
    async with httpx.AsyncClient(timeout=60) as client:
        reference = await client.post(f"{s.base}/v1/chat/completions", json=_chat(200, False))
        expected = reference.json()["choices"][0]["message"]["content"]
        text, frames = "", 0
        async with client.stream("POST", f"{s.base}/v1/chat/completions", json=_chat(200)) as r:
            rid = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                frames += 1
                for choice in json.loads(line[6:]).get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
                if frames == 10:
                    port = s.cluster.primary_of(f"sluice:events:{{{rid}}}")
                    s.cluster.kill(port)
                    killed.append(port)
                    killed_at = time.monotonic()
        assert killed, "the stream ended before the kill"
        assert time.monotonic() - killed_at < 30
        assert text == expected, (text, expected, s.logs())
