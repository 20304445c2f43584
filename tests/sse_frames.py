"""Reading what the API streamed, for the tests: a body's SSE events, the text of each of a
request's choices, and each choice's event log on Redis, checked against the invariants."""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from shared import keys
from shared.codec import decode_entries
from shared.events import AnyEvent
from shared.jobs import choice_id
from tests.invariants import check_stream


def data_frames(body: str) -> list[tuple[str | None, str]]:
    """(id, data) of every SSE event in ``body`` (comments skipped)."""
    out = []
    for block in body.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        ids = [line[4:] for line in lines if line.startswith("id: ")]
        data = "\n".join(line[6:] for line in lines if line.startswith("data: "))
        if data:
            out.append((ids[0] if ids else None, data))
    return out


def choice_texts(frames: list[tuple[str | None, str]], n: int) -> list[str]:
    """Each of ``n`` choices' content, from Chat chunks' ``choices[].delta``."""
    texts = [""] * n
    for _, data in frames:
        if data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
    return texts


async def choice_logs(redis: aioredis.Redis, rid: str, n: int) -> list[list[AnyEvent]]:
    """The events of each of request ``rid``'s ``n`` choices, each checked as one stream."""
    out = []
    for i in range(n):
        events = decode_entries(await redis.xrange(keys.events(choice_id(rid, i))))
        check_stream(events)
        out.append(events)
    return out
