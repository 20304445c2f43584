"""Reading a Chat Completions stream the way a client does, with a clock on it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

__all__ = ["ChatStream", "read_chat"]


@dataclass
class ChatStream:
    """What a client got: the text, the finish reason or error, and when the stream ended."""

    text: str = ""
    finish_reason: str | None = None
    error: dict[str, object] | None = None
    done: bool = False
    chunks: int = 0
    ended_at: float = 0.0
    status: int = 0
    frames: list[str] = field(default_factory=list)


async def read_chat(
    client: httpx.AsyncClient,
    base: str,
    body: dict[str, object],
    *,
    after_chunks: int = 0,
    hook: Callable[[], object] | None = None,
) -> ChatStream:
    """Stream ``body`` and call ``hook`` once ``after_chunks`` content chunks have arrived."""
    got = ChatStream()
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as reply:
        got.status = reply.status_code
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            got.frames.append(data)
            if data == "[DONE]":
                got.done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                got.error = chunk["error"]
                continue
            for choice in chunk.get("choices", []):
                got.text += choice.get("delta", {}).get("content") or ""
                got.finish_reason = choice.get("finish_reason") or got.finish_reason
            got.chunks += 1
            if hook is not None and got.chunks == after_chunks:
                hook()
    got.ended_at = time.monotonic()
    return got


def chat_body(model: str, max_tokens: int, stream: bool = True) -> dict[str, object]:
    """A one-word chat request for ``model`` (the scripted doubles answer it with known text)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
