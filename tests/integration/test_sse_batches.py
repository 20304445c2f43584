"""Entries the hub reads together leave as one HTTP body message, intact, through real uvicorn.

The SSE response (``services/api/sse_asgi.py``) sends everything one hub wake-up produced for a
stream as one ``http.response.body`` message, straight to the server's ``send``. Entries written
in one MULTI/EXEC reach the hub in one XREAD reply, so they must arrive as one HTTP/1.1 chunk
holding every frame in order, each with its own entry id, and the official openai SDK must
parse such a chunk into the same completion. The access log and the HTTP metrics, which see
only a stream's start and end, must still count it.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.codec import decode_event, encode_entry
from shared.events import AnyEvent, Finish, Start, TextDelta, Usage
from shared.model_card import ModelCard
from tests.integration.test_api_native import create, xadd
from tests.metrics_text import sample

pytestmark = pytest.mark.integration

WORDS = 40


def body_events(rid: str) -> list[AnyEvent]:
    """Every event after ``Start``: the deltas, Usage and Finish."""
    deltas: list[AnyEvent] = [TextDelta(text=f" w{i}", token_ids=[10 + i]) for i in range(WORDS)]
    return [*deltas, Usage(input_tokens=3, output_tokens=WORDS), Finish(reason="end_turn")]


async def publish_at_once(redis: aioredis.Redis, rid: str, events: list[AnyEvent]) -> list[str]:
    """XADD ``events`` as separate entries in one transaction; returns their entry ids."""
    async with redis.pipeline(transaction=True) as pipe:
        for event in events:
            pipe.xadd(keys.events(rid), encode_entry(event))  # type: ignore[arg-type]
        ids: list[bytes] = await pipe.execute()
    return [i.decode() for i in ids]


class RawStream:
    """An HTTP/1.1 GET read off the socket: the chunks of its chunked body, as sent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, base_url: str, path: str) -> RawStream:
        url = urlsplit(base_url)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower()
        return cls(reader, writer)

    async def chunk(self) -> bytes:
        size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
        data = await self.reader.readexactly(size + 2)
        return data[:-2]

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def frames(chunk: bytes) -> list[dict[str, str]]:
    """The SSE events of a chunk holding whole events (``{event, id, data}``)."""
    out = []
    for block in chunk.decode().split("\n\n"):
        if block and not block.startswith(":"):
            out.append(dict(line.split(": ", 1) for line in block.split("\n")))
    return out


async def test_entries_read_together_leave_as_one_chunk_with_every_id(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        rid = await create(client)
    stream = await RawStream.open(api, f"/v1/requests/{rid}/events")
    try:
        start_id = await xadd(redis, rid, Start(request_id=rid, model="tiny-test", prompt_tokens=3))
        first = await asyncio.wait_for(stream.chunk(), 10)
        while first.startswith(b":"):  # a keepalive came first
            first = await asyncio.wait_for(stream.chunk(), 10)
        assert [f["id"] for f in frames(first)] == [start_id]
        events = body_events(rid)
        ids = await publish_at_once(redis, rid, events)
        batch = await asyncio.wait_for(stream.chunk(), 10)
        while batch.startswith(b":"):
            batch = await asyncio.wait_for(stream.chunk(), 10)
        got = frames(batch)
        assert [f["id"] for f in got] == ids  # all of them, in one body message
        decoded = [
            decode_event(msgspec.msgpack.encode(msgspec.json.decode(f["data"]))) for f in got
        ]
        assert decoded == events
        assert [f["event"] for f in got] == [e.__struct_config__.tag for e in events]
        assert await asyncio.wait_for(stream.chunk(), 10) == b""  # the end, after Finish
    finally:
        await stream.close()


async def test_openai_sdk_reads_a_batched_body(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    async with (
        openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as sdk,
        sdk.chat.completions.with_streaming_response.create(
            model="tiny-test",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        ) as response,
    ):
        rid = response.headers["x-request-id"]
        await xadd(redis, rid, Start(request_id=rid, model="tiny-test", prompt_tokens=3))
        await publish_at_once(redis, rid, body_events(rid))
        chunks = [c async for c in await response.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(f" w{i}" for i in range(WORDS))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == WORDS


async def test_a_stream_is_counted_in_the_http_metrics(
    api: str, redis: aioredis.Redis, tiny_model: ModelCard
) -> None:
    """Its start and end still pass through ``Observe``: one 200 for the stream's route."""
    route = {"route": "/v1/requests/{rid}/events", "method": "GET"}

    async def served(client: httpx.AsyncClient, status: str) -> float:
        text = (await client.get("/metrics")).text
        return sample(text, "sluice_http_requests_total", status=status, **route)

    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        before = await served(client, "200")
        rid = await create(client)
        await xadd(redis, rid, Start(request_id=rid, model="tiny-test", prompt_tokens=3))
        await publish_at_once(redis, rid, body_events(rid))
        replay = await client.get(f"/v1/requests/{rid}/events")
        assert replay.status_code == 200 and "event: finish" in replay.text
        # Counted once the response returns, which can be just after the client read its end.
        for _ in range(200):
            if await served(client, "200") > before:
                break
            await asyncio.sleep(0.025)
        assert await served(client, "200") == before + 1
        assert await served(client, "499") == 0
