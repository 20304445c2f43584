"""Structured logs through real uvicorn and a real worker: the fields every line carries, one
access line per request, and no prompt or output text unless ``SLUICE_LOG_CONTENT`` allows it.

The worker runs the ``echo`` script, so its output repeats the prompt: one marker word tells
whether either leaked into a log line.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from shared import logs
from shared.config import Settings
from tests.integration.server_harness import running_api
from tests.integration.worker_harness import running_worker

pytestmark = pytest.mark.integration


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """Every log line of this process as JSON, at INFO, for the duration of the test."""
    stream = io.StringIO()
    handler = logs.make_handler(stream, json_lines=True)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logs.set_content(False)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def one(entries: list[dict[str, Any]], msg: str, rid: str) -> dict[str, Any]:
    [entry] = [e for e in entries if e["msg"] == msg and e.get("request_id") == rid]
    return entry


async def settled(stream: io.StringIO, rid: str) -> list[dict[str, Any]]:
    """The lines once the request's access line and "generation ended" are both written.

    The client has its answer before either is logged (the access line after the body's last
    chunk went out, "generation ended" after the terminal event was published), so on a slow
    machine they can land a moment after the reply: wait for them, up to 10 s.
    """
    for _ in range(200):
        entries = lines(stream)
        mine = {e["msg"] for e in entries if e.get("request_id") == rid}
        access = any(e["logger"] == "sluice.access" for e in entries if e.get("request_id") == rid)
        if access and "generation ended" in mine:
            return entries
        await asyncio.sleep(0.05)
    return lines(stream)


async def ask(api: str, model: str, text: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{api}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert text in reply.json()["choices"][0]["message"]["content"]
    rid: str = reply.json()["id"]
    return rid


async def test_lines_carry_request_fields_and_no_content(
    captured: io.StringIO, settings: Settings, redis: aioredis.Redis, redis_url: str
) -> None:
    async with (
        running_api(settings) as api,
        running_worker(redis_url, "scripted:echo?rate=0", wid="log-w") as worker,
    ):
        rid = await ask(api, worker.name, "zebra quokka")
        entries = await settled(captured, rid)
        assert "zebra" not in captured.getvalue()

        access = [e for e in entries if e["logger"] == "sluice.access"]
        [line] = [e for e in access if e.get("request_id") == rid]
        assert line["method"] == "POST" and line["route"] == "/v1/chat/completions"
        assert line["status"] == 200 and line["format"] == "openai_chat"
        assert line["model"] == worker.name
        assert line["input_tokens"] > 0 and line["output_tokens"] > 0
        assert line["duration_ms"] > 0
        assert all(e["path"] != "/healthz" for e in access)

        for msg in ("generation started", "generation ended"):
            entry = one(entries, msg, rid)
            assert entry["model"] == worker.name
            assert entry["worker"] == "log-w"
            assert entry["attempt"] == 1
            assert "prompt" not in entry and "output" not in entry
        assert one(entries, "generation ended", rid)["finish_reason"] == "end_turn"

        logs.set_content(True)  # as SLUICE_LOG_CONTENT=true does through configure()
        rid = await ask(api, worker.name, "zebra giraffe")
        entries = await settled(captured, rid)
        assert "zebra giraffe" in one(entries, "generation started", rid)["prompt"]
        assert "zebra giraffe" in one(entries, "generation ended", rid)["output"]
