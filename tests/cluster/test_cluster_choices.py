"""``n`` > 1 with the event logs on a Redis Cluster: the choices' logs live in different slots
(each choice is a request with its own hash tag), and one merged stream, its resume and the
cancel of every choice still work.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from tests.chaos.sse_reader import chat_body
from tests.cluster.conftest import MODEL, Stack

pytestmark = pytest.mark.integration


def _frames(body: str) -> list[tuple[str | None, str]]:
    out = []
    for block in body.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        ids = [line[4:] for line in lines if line.startswith("id: ")]
        data = "\n".join(line[6:] for line in lines if line.startswith("data: "))
        if data:
            out.append((ids[0] if ids else None, data))
    return out


def _texts(frames: list[tuple[str | None, str]], n: int) -> list[str]:
    texts = [""] * n
    for _, data in frames:
        if data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
    return texts


async def test_three_choices_stream_resume_and_cancel(cluster_stack: Callable[..., Stack]) -> None:
    s = cluster_stack()
    async with httpx.AsyncClient(timeout=60) as client:
        whole = await client.post(
            f"{s.base}/v1/chat/completions", json={**chat_body(MODEL, 40, False), "n": 3}
        )
        assert whole.status_code == 200, whole.text + s.logs()
        expected = [c["message"]["content"] for c in whole.json()["choices"]]
        streamed = await client.post(
            f"{s.base}/v1/chat/completions", json={**chat_body(MODEL, 40, True), "n": 3}
        )
        frames = _frames(streamed.text)
        assert _texts(frames, 3) == expected, s.logs()
        rid = streamed.headers["x-request-id"]
        cut = [k for k, (i, _) in enumerate(frames) if i][4] + 1
        resumed = await client.get(
            f"{s.base}/v1/chat/completions/{rid}/events",
            headers={"last-event-id": str(frames[cut - 1][0])},
        )
        assert _texts(frames[:cut] + _frames(resumed.text), 3) == expected
        cancelled = await client.post(f"{s.base}/v1/requests/{rid}/cancel")
        assert cancelled.status_code == 200, cancelled.text
