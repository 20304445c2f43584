"""API and worker together: native request → arq → scripted worker → Redis stream → SSE.

Everything is real except the choice of tokens (the scripted backend, a test double).
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.codec import decode_entries, decode_entry
from shared.events import AnyEvent, Error, Finish, TextDelta, is_terminal
from sluice_client import LiveSource, RecordedSource, export_stream, read_all
from tests.integration.test_api_native import sse_events
from tests.integration.worker_harness import running_worker
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

_EVENT = msgspec.json.Decoder(AnyEvent)


def job(model: str, script: str = "text") -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "metadata": {"script": script},
    }


async def stored_events(redis: aioredis.Redis, rid: str) -> list[AnyEvent]:
    return decode_entries(await redis.xrange(keys.events(rid)))


async def wait_terminal(redis: aioredis.Redis, rid: str) -> list[AnyEvent]:
    last = "0-0"
    events: list[AnyEvent] = []
    while not events or not is_terminal(events[-1]):
        reply = await redis.xread({keys.events(rid): last}, block=5_000)
        assert reply, "no terminal event within the block time"
        for raw_id, fields in reply[0][1]:
            last = raw_id.decode()
            events.extend(decode_entry(fields))
    return events


async def test_native_request_streams_through_the_worker(
    api: str, redis: aioredis.Redis, redis_url: str
) -> None:
    async with (
        running_worker(redis_url, "scripted:text?rate=40") as worker,
        httpx.AsyncClient(base_url=api, timeout=20) as client,
    ):
        created = await client.post("/v1/requests", json=job(worker.name))
        assert created.status_code == 200, created.text
        rid = created.json()["id"]
        received: list[AnyEvent] = []
        terminal_stored_at_first_text: bool | None = None
        async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
            async for frame in sse_events(response):
                if "comment" in frame:
                    continue
                event = _EVENT.decode(frame["data"])
                if isinstance(event, TextDelta) and terminal_stored_at_first_text is None:
                    tail = await redis.xrevrange(keys.events(rid), count=1)
                    terminal_stored_at_first_text = is_terminal(decode_entry(tail[0][1])[-1])
                received.append(event)
    check_stream(received)
    assert isinstance(received[-1], Finish) and received[-1].reason == "end_turn"
    assert received == await stored_events(redis, rid)
    # incremental: the client held the first text before the worker had written the end
    assert terminal_stored_at_first_text is False


async def test_disconnect_cancels_the_generation(
    api: str, redis: aioredis.Redis, redis_url: str
) -> None:
    async with (
        running_worker(redis_url, "scripted:text?rate=50") as worker,
        httpx.AsyncClient(base_url=api, timeout=20) as client,
    ):
        rid = (await client.post("/v1/requests", json=job(worker.name, "long"))).json()["id"]
        async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
            async for frame in sse_events(response):
                if frame.get("event") == "text":
                    break  # mid-stream: drop the connection
        events = await wait_terminal(redis, rid)
    assert await redis.get(keys.cancel(rid)) == b"1"
    check_stream(events)
    assert events[-1] == Finish(reason="cancelled", token_ids=events[-1].token_ids)  # type: ignore[union-attr]
    assert sum(isinstance(e, TextDelta) for e in events) < 600  # cut well before the end


async def test_backend_error_reaches_the_client(api: str, redis_url: str) -> None:
    async with running_worker(redis_url, "scripted:error?rate=0") as worker:
        source = LiveSource(api, job=job(worker.name, "error"))
        events = await read_all(source)
    check_stream(events)
    assert isinstance(events[-1], Error)


async def test_client_live_export_and_replay(
    api: str, redis: aioredis.Redis, redis_url: str, tmp_path: object
) -> None:
    from pathlib import Path

    assert isinstance(tmp_path, Path)
    async with running_worker(redis_url, "scripted:reasoning?rate=0") as worker:
        source = LiveSource(api, job=job(worker.name, "reasoning"))
        live = [item async for item in source.events()]
    assert source.request_id is not None and source.reconnects == 0
    events = [item.event for item in live]
    check_stream(events)
    assert events == await stored_events(redis, source.request_id)
    path = tmp_path / "stream.jsonl"
    assert await export_stream(redis_url, source.request_id, path) == len(events)
    replayed = [item async for item in RecordedSource(path).events()]
    assert replayed == live
    assert [i.t_ms for i in replayed] == sorted(i.t_ms for i in replayed) and replayed[0].t_ms == 0


class DroppingProxy:
    """A TCP proxy that cuts the first event stream after the chunk with frame ``cut_after``."""

    def __init__(self, upstream_port: int, cut_after: int) -> None:
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        cut = self.connections == 2  # connection 1 is the POST, 2 the first event stream
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: bool) -> None:
            frames = 0
            try:
                while chunk := await src.read(65536):
                    dst.write(chunk)
                    await dst.drain()
                    if count and cut:
                        frames += chunk.count(b"event: ")
                        if frames >= self.cut_after:
                            break  # drop the connection mid-stream
            finally:
                dst.close()

        await asyncio.gather(
            pump(reader, up_writer, False), pump(up_reader, writer, True), return_exceptions=True
        )

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


async def test_client_resumes_after_a_dropped_connection(
    api: str, redis: aioredis.Redis, redis_url: str
) -> None:
    async with running_worker(redis_url, "scripted:text?rate=50") as worker:
        proxy = DroppingProxy(int(api.rsplit(":", 1)[1]), cut_after=2)
        base = await proxy.start()
        try:
            source = LiveSource(base, job=job(worker.name, "text"))
            live = [item async for item in source.events()]
        finally:
            await proxy.stop()
    assert source.reconnects == 1 and proxy.connections >= 3
    events = [item.event for item in live]
    check_stream(events)
    assert source.request_id is not None
    assert events == await stored_events(redis, source.request_id)  # nothing lost or repeated
    # the drop was followed by a resume within the grace period: the answer was not cancelled
    assert isinstance(events[-1], Finish) and events[-1].reason == "end_turn"
    # Each event carries the id of its entry (a decode step's events share one): ids run in log
    # order, and every entry of the log was delivered once.
    entries = [raw.decode() for raw, _ in await redis.xrange(keys.events(source.request_id))]
    ids = [item.id for item in live]
    assert sorted(set(ids), key=ids.index) == entries


async def test_cli_export_and_replay(
    api: str, redis_url: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    from shared.config import Settings
    from sluice_client import StreamEvent, cli_export, cli_replay

    assert isinstance(tmp_path, Path)
    async with running_worker(redis_url, "scripted:tool_call?rate=0") as worker:
        source = LiveSource(api, job=job(worker.name, "tool_call"))
        live = [item async for item in source.events()]
    assert source.request_id is not None
    settings = Settings(redis_url=redis_url)
    out = tmp_path / "export.jsonl"
    assert await asyncio.to_thread(cli_export, settings, source.request_id, str(out)) == 0
    assert await asyncio.to_thread(cli_export, settings, "req_missing", str(out) + ".x") == 1
    capsys.readouterr()
    assert await asyncio.to_thread(cli_replay, settings, str(out), False) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [msgspec.json.decode(line, type=StreamEvent) for line in printed] == live
    check_stream([item.event for item in live])
