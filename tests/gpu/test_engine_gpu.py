"""The default model on CUDA in bf16: correctness and batched throughput (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.worker.engine import TorchBackend, load_backend
from shared.config import Settings
from shared.events import AnyEvent, TextDelta
from shared.jobs import GenerateRequest, Message, SamplingParams, TextPart
from tests.invariants import check_stream, generated_token_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def ask(text: str, rid: str, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="smollm2",
        messages=[Message(role="user", content=[TextPart(text=text)])],
        sampling=SamplingParams(temperature=0.0),
        **kw,  # type: ignore[arg-type]
    )


async def run(b: TorchBackend, job: GenerateRequest) -> list[AnyEvent]:
    events: list[AnyEvent] = []
    async for batch in b.generate(job, [], 1):
        events.extend(batch)
    check_stream(events)
    return events


async def test_cuda_bf16_default_model() -> None:
    b = load_backend(Settings(device="cuda", max_batch=16), "smollm2", None)
    assert b.loaded.dtype == torch.bfloat16 and b.loaded.device.type == "cuda"
    await b.start()
    try:
        events = await run(b, ask("What is the capital of France?", "r0", max_tokens=40))
        assert "Paris" in "".join(e.text for e in events if isinstance(e, TextDelta))
        jobs = [
            ask(f"Count to {i + 3}.", f"r{i}", max_tokens=32, ignore_eos=True) for i in range(4)
        ]
        alone = [generated_token_ids(await run(b, j)) for j in jobs]
        b.scheduler.cache.tokens = [[] for _ in range(b.max_batch)]
        together = await asyncio.gather(*(run(b, j) for j in jobs))
        # bf16 batched matmuls may round differently from B=1; require the first tokens to agree.
        for got, want in zip((generated_token_ids(e) for e in together), alone, strict=True):
            assert got[:8] == want[:8]
        many = [
            ask(f"Tell me a story number {i}.", f"s{i}", max_tokens=64, ignore_eos=True)
            for i in range(16)
        ]
        began = time.perf_counter()
        results = await asyncio.gather(*(run(b, j) for j in many))
        elapsed = time.perf_counter() - began
        tokens = sum(len(generated_token_ids(e)) for e in results)
        assert tokens == 16 * 64
        print(f"cuda bf16 B=16: {tokens / elapsed:.0f} tok/s aggregate")
    finally:
        await b.stop()
