"""Redis reaches ``maxmemory`` (``noeviction``) while streams run, then memory is freed.

A private redis-server with a small ``maxmemory`` is filled by a filler key in the middle of 16
streams (real ``sluice worker`` on the scripted backend, real ``sluice api``), held full for a
few seconds and freed. New requests in every format must get a 503 with ``Retry-After``, never
a 500 or a dropped connection; the running streams pause and then complete, each with exactly
one terminal event, and no client ever sees Redis's own words.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import pytest
import redis

from services.worker.scripted import LONG_WORDS
from tests.chaos.conftest import LONG_MODEL, Stack
from tests.chaos.sse_reader import ChatStream, chat_body, read_chat

pytestmark = pytest.mark.integration

STREAMS = 16
TOKENS = 900  # about 6 s at the stack's 150 tokens/s: the outage falls in the middle
FULL_S = 3.0
HEADROOM = 4 * 1024 * 1024  # maxmemory above what the idle stack uses
PIECE = 256 * 1024  # the filler grows by this until Redis refuses it

# Redis's wording (and a script's hash) must never reach a client.
RAW = ("OOM command", "maxmemory", "script:", "@user_script", "ResponseError")


def _new_requests(model: str) -> list[tuple[str, dict[str, object]]]:
    message = [{"role": "user", "content": "go"}]
    native = [{"role": "user", "content": [{"type": "text", "text": "go"}]}]
    return [
        ("/v1/chat/completions", chat_body(model, 8, stream=True)),
        ("/v1/chat/completions", chat_body(model, 8, stream=False)),
        ("/v1/messages", {"model": model, "max_tokens": 8, "messages": message, "stream": True}),
        ("/v1/responses", {"model": model, "input": "go", "max_output_tokens": 8}),
        ("/v1/requests", {"model": model, "messages": native, "max_tokens": 8}),
    ]


def _check_refusal(path: str, reply: httpx.Response) -> None:
    assert reply.status_code == 503, (path, reply.status_code, reply.text)
    assert reply.headers.get("retry-after") == "1", (path, reply.headers)
    body = reply.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
    else:
        assert body["error"]["type"] == "server_error", body
    assert not any(raw in reply.text for raw in RAW), reply.text


async def test_streams_ride_out_a_full_redis(stack: Callable[..., Stack]) -> None:
    s = stack(aof=False)
    admin = s.redis.client()
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", used + HEADROOM)
    refused: list[tuple[str, httpx.Response]] = []
    full: dict[str, float] = {}

    async with httpx.AsyncClient(timeout=60) as client:

        async def fill_hold_free() -> None:
            for _ in range(4 * HEADROOM // PIECE):
                try:
                    admin.append("filler", b"x" * PIECE)
                except redis.exceptions.OutOfMemoryError:
                    break
            else:
                pytest.fail("Redis never refused the filler")
            # The refused piece's own buffer was what crossed the limit; with it gone a small
            # write would fit again. Hold Redis just past full, as a growing dataset leaves it.
            admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) - PIECE)
            full["at"] = time.monotonic()
            for path, body in _new_requests(LONG_MODEL):
                refused.append((path, await client.post(f"{s.base}{path}", json=body)))
            await asyncio.sleep(max(0.0, FULL_S - (time.monotonic() - full["at"])))
            admin.delete("filler")
            full["freed"] = time.monotonic()

        started = asyncio.Event()
        chunks = [0] * STREAMS

        async def one(i: int) -> ChatStream:
            def seen() -> None:
                chunks[i] = 1
                if sum(chunks) == STREAMS:
                    started.set()

            body = chat_body(LONG_MODEL, TOKENS)
            return await read_chat(client, s.base, body, after_chunks=3, hook=seen)

        readers = [asyncio.ensure_future(one(i)) for i in range(STREAMS)]
        await asyncio.wait_for(started.wait(), 30)
        await fill_hold_free()
        got = await asyncio.gather(*readers)
        again = chat_body(LONG_MODEL, TOKENS, stream=False)
        after = await client.post(f"{s.base}/v1/chat/completions", json=again)

    assert len(refused) == len(_new_requests(LONG_MODEL))
    for path, reply in refused:
        _check_refusal(path, reply)
    assert after.status_code == 200, after.text + s.logs()
    expected = after.json()["choices"][0]["message"]["content"]
    assert " ".join(f"w{k}" for k in range(LONG_WORDS)).startswith(expected)
    for stream in got:
        frames = "\n".join(stream.frames)
        assert not any(raw in frames for raw in RAW), stream.frames[-3:]
        terminals = [f for f in stream.frames if f != "[DONE]" and _terminal(f)]
        assert len(terminals) == 1 and stream.done, (stream.frames[-3:], s.logs())
        assert stream.error is None, (stream.error, s.logs())
        assert stream.finish_reason == "length"
        assert stream.text == expected, stream.text[-80:]  # each token exactly once
        assert stream.ended_at > full["freed"], "a stream ended before the outage was over"


def _terminal(frame: str) -> bool:
    chunk = json.loads(frame)
    if "error" in chunk:
        return True
    return any(c.get("finish_reason") for c in chunk.get("choices", []))
