"""The end-to-end paths with the event log on a Redis Cluster and arq on a single Redis."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from tests.chaos.sse_reader import chat_body
from tests.cluster.conftest import MODEL, Stack

pytestmark = pytest.mark.integration


def _chat(max_tokens: int, stream: bool = True) -> dict[str, object]:
    return chat_body(MODEL, max_tokens, stream)


async def _sse(reply: httpx.Response) -> list[tuple[str | None, str, str]]:
    """(id, event, data) for every frame with data."""
    frames: list[tuple[str | None, str, str]] = []
    entry_id: str | None = None
    event = ""
    async for line in reply.aiter_lines():
        if line.startswith("id: "):
            entry_id = line[4:]
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            frames.append((entry_id, event, line[6:]))
        elif not line:
            entry_id, event = None, ""
    return frames


def _chat_text(frames: list[tuple[str | None, str, str]]) -> str:
    text = ""
    for _, _, data in frames:
        if data != "[DONE]":
            for choice in json.loads(data).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


def _typed_text(frames: list[tuple[str | None, str, str]], kind: str) -> str:
    """Responses (``response.output_text.delta``) or Messages (``text_delta``) text."""
    text = ""
    for _, event, data in frames:
        body = json.loads(data)
        if kind == "responses" and event == "response.output_text.delta":
            text += body["delta"]
        if kind == "messages" and event == "content_block_delta":
            text += body["delta"].get("text", "")
    return text


async def test_three_formats_resume_and_replay(cluster_stack: Callable[..., Stack]) -> None:
    s = cluster_stack()
    async with httpx.AsyncClient(timeout=60) as client:
        reference = await client.post(f"{s.base}/v1/chat/completions", json=_chat(40, False))
        assert reference.status_code == 200, reference.text + s.logs()
        expected = reference.json()["choices"][0]["message"]["content"]
        async with client.stream("POST", f"{s.base}/v1/chat/completions", json=_chat(40)) as r:
            rid = r.headers["x-request-id"]
            chat = await _sse(r)
        assert _chat_text(chat) == expected, s.logs()
        body = {"model": MODEL, "input": "go", "max_output_tokens": 40, "stream": True}
        async with client.stream("POST", f"{s.base}/v1/responses", json=body) as r:
            assert _typed_text(await _sse(r), "responses") == expected, s.logs()
        body = {"model": MODEL, "max_tokens": 40, "stream": True}
        body["messages"] = [{"role": "user", "content": "go"}]
        async with client.stream("POST", f"{s.base}/v1/messages", json=body) as r:
            assert _typed_text(await _sse(r), "messages") == expected, s.logs()
        # Resume after the fifth frame with Last-Event-ID: exactly the rest.
        ids = [i for i, _, _ in chat if i]
        headers = {"last-event-id": ids[4]}
        url = f"{s.base}/v1/chat/completions/{rid}/events"
        async with client.stream("GET", url, headers=headers) as r:
            rest = _chat_text(await _sse(r))
        assert _chat_text(chat[:5]) + rest == expected
        # Replay the same request in another format (native events) from the start.
        async with client.stream("GET", f"{s.base}/v1/requests/{rid}/events") as r:
            native = await _sse(r)
        # One entry per decode step: its last frame carries the entry id (the log's last too).
        assert native and native[-1][0], native[-3:]
        assert set(ids) <= {i for i, _, _ in native}  # the same log, the same entry ids
