"""``n`` > 1 with the event logs on a Redis Cluster: the choices' logs live in different slots
(each choice is a request with its own hash tag), and one merged stream, its resume and the
cancel of every choice still work.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.chaos.sse_reader import chat_body
from tests.cluster.conftest import MODEL, Stack
from tests.sse_frames import choice_texts, data_frames

pytestmark = pytest.mark.integration


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
        frames = data_frames(streamed.text)
        assert choice_texts(frames, 3) == expected, s.logs()
        rid = streamed.headers["x-request-id"]
        cut = [k for k, (i, _) in enumerate(frames) if i][4] + 1
        resumed = await client.get(
            f"{s.base}/v1/chat/completions/{rid}/events",
            headers={"last-event-id": str(frames[cut - 1][0])},
        )
        assert choice_texts(frames[:cut] + data_frames(resumed.text), 3) == expected
        cancelled = await client.post(f"{s.base}/v1/requests/{rid}/cancel")
        assert cancelled.status_code == 200, cancelled.text
