"""``n`` > 1 on a real (tiny, random-weight) model served by the real worker: the n choices share
the prompt's prefill (the paged cache's prefix sharing: one choice computes the prompt, the
others wait for its blocks and find them cached). Seeds need a model whose samples vary, so
they are checked on the default model (``test_choices_default_model.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from services.worker.loaders import load_model
from services.worker.main import start_worker
from services.worker.torch_backend import TorchBackend
from shared.config import Settings
from shared.events import Start
from tests.sse_frames import choice_logs
from tests.worker_models import write_hf_model

pytestmark = pytest.mark.integration

MODEL = "tiny-choices"
# Long enough for several whole KV blocks (16 tokens each) ahead of the last prompt token.
ASK: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You answer questions about the weather in short sentences."},
    {"role": "user", "content": "What is the weather like in Paris and in Rome this week?"},
]


@pytest.fixture
async def tiny_worker(redis_url: str, redis: aioredis.Redis, tmp_path: Path) -> AsyncIterator[None]:
    write_hf_model(tmp_path / MODEL, "LlamaForCausalLM", seed=3, max_position_embeddings=1024)
    loaded = load_model(str(tmp_path / MODEL), device="cpu")
    settings = Settings.from_env({}, redis_url=redis_url, lease_ttl_s=10.0, heartbeat_s=0.5)
    worker = await start_worker(settings, TorchBackend(loaded, max_batch=8))
    try:
        yield
    finally:
        await worker.stop(0.5)


def client(api: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0)


async def test_choices_share_the_prompt_s_prefill(
    api: str, tiny_worker: None, redis: aioredis.Redis
) -> None:
    async with client(api) as c:
        done = await c.chat.completions.create(
            model=MODEL, messages=ASK, n=4, max_tokens=4, temperature=1.0
        )
    logs = await choice_logs(redis, done.id, 4)
    starts = [events[0] for events in logs]
    assert all(isinstance(s, Start) for s in starts)
    prompt = starts[0].prompt_tokens  # type: ignore[union-attr]
    whole_blocks = (prompt - 1) // 16 * 16  # the last prompt token is always computed
    assert whole_blocks >= 32, prompt
    cached = sorted(s.cached_tokens for s in starts)  # type: ignore[union-attr]
    # One choice computed the prompt; the other three waited for its blocks and shared them.
    assert cached == [0, whole_blocks, whole_blocks, whole_blocks], (cached, prompt)
    assert done.usage is not None and done.usage.prompt_tokens == prompt
