"""Run the real API app under a real uvicorn server in a background thread.

A thread (not the test's event loop) so that synchronous clients such as the official SDKs can
call it from the test without deadlocking, and so that streaming, disconnects and timing are
those of a real socket: ``httpx.ASGITransport`` buffers whole bodies (encode/httpx#3059).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers

from services.api.app import create_app
from shared import keys
from shared.config import Settings
from shared.model_card import ModelCard, encode_card

__all__ = ["TINY_TEMPLATE", "announce_worker", "publish_card", "running_api", "tiny_card"]


@contextlib.asynccontextmanager
async def running_api(settings: Settings, *, startup_s: float = 20.0) -> AsyncIterator[str]:
    """Serve ``create_app(settings)`` on a free loopback port for the duration of the block.

    Args:
        settings: the app settings (host/port are ignored: a free port is picked).
        startup_s: how long to wait for the lifespan to finish starting.

    Yields:
        The base URL, e.g. ``http://127.0.0.1:41234``.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_app(settings), log_level="warning", lifespan="on", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as exc:  # surfaced to the test below
            failure.append(exc)

    thread = threading.Thread(target=serve, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + startup_s
    while not server.started:
        if failure or not thread.is_alive():
            raise RuntimeError(f"API server failed to start: {failure!r}")
        if loop.time() > deadline:
            raise TimeoutError("API server did not start in time")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.to_thread(thread.join, 10)
        sock.close()


TINY_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_card(name: str = "tiny-test", context_length: int = 64) -> ModelCard:
    """A real (tiny) model card: a word-level tokenizer and a one-line chat template.

    Args:
        name: the public model id.
        context_length: the context window, small so overflow is easy to provoke.

    Returns:
        The card, as a worker would publish it.
    """
    words = ["<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "</s>"]
    words += [
        w
        for w in [
            "hello",
            "world",
            "hi",
            "there",
            "how",
            "are",
            "you",
            "a",
            "b",
            "c",
            "d",
            "e",
            "f",
            "g",
            "h",
        ]
    ]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return ModelCard(
        name=name,
        architecture="scripted",
        context_length=context_length,
        tokenizer_json=tok.to_str(),
        chat_template=TINY_TEMPLATE,
        eos_token="</s>",
        eos_token_ids=[vocab["</s>"]],
        created=1_700_000_000,
    )


async def publish_card(redis: aioredis.Redis, card: ModelCard) -> None:
    """Publish ``card`` where workers do (``sluice:model:{name}``, ``sluice:models``)."""
    await redis.hset(keys.model_card(card.name), mapping={"card": encode_card(card)})  # type: ignore[misc]
    await redis.sadd(keys.models(), card.name)  # type: ignore[misc]


async def announce_worker(redis: aioredis.Redis, model: str, wid: str = "w-test") -> None:
    """Write one heartbeat for ``model`` the way a worker does (hash with TTL + index zset)."""
    await redis.hset(keys.worker(wid), mapping={"model": model, "slots": 4, "active": 0})  # type: ignore[misc]
    await redis.expire(keys.worker(wid), 30)
    await redis.zadd(keys.workers(), {wid: int(time.time() * 1000)})
