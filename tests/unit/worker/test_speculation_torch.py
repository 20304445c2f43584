"""Speculation off the CPU kernels: torch's model, and the GPU's batched token chooser (run here
on CPU tensors).

Torch's GEMMs are not batch-invariant: a row's logits differ in their last bits with the rows
beside it, as they already do when the batch changes, so a verified draft can only be compared
up to that. The torch model's speculative greedy output must equal its plain output wherever the
plain run's best token won by more than float noise; where they part, the plain run's two best
candidates must tie within it. A wrong verification (a draft token kept that the model did not
choose) parts them at a clear winner and fails.

The batched chooser (``TokenChooser.batch``, the GPU engine's) draws from a counter: the seeded
draw at a position is a function of (seed, position, logits), so on the kernels' batch-invariant
model a speculating backend draws exactly what a plain one draws, token for token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.worker.models.llama import LlamaModel
from services.worker.token_choice import TokenChooser
from services.worker.torch_backend import TorchBackend
from shared.jobs import SamplingParams
from tests.determinism import Greedy, greedy
from tests.unit.worker.test_speculation import (
    MODELS,
    _job,
    _prompts,
    _run,
    _stats,
    backends,
    pair,
)

__all__ = ["pair"]  # the fixture, shared with test_speculation

torch.set_num_threads(2)

TIE = 1e-4  # log-probability gap within which float noise may pick either token


@pytest.fixture
async def torch_pair(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[TorchBackend, TorchBackend]]:
    """A plain and a speculating backend over one tiny fp32 model on torch (not the kernels)."""
    arch, seed = request.param
    async for both in backends(tmp_path, arch, seed, "float32"):
        assert isinstance(both[0].scheduler.model, LlamaModel)
        yield both


def _agree_up_to_ties(got: Greedy, want: Greedy) -> None:
    """``got`` is ``want`` until they part, and they part only where ``want``'s two best
    candidates tie within float noise (after that each follows its own text)."""
    for i, (g, w) in enumerate(zip(got.tokens, want.tokens, strict=True)):
        if g != w:
            best, second = want.logprobs[i][1][:2]
            assert best - second < TIE, f"parted at {i} where the best token won by {best - second}"
            return
        assert got.logprobs[i][0] == pytest.approx(want.logprobs[i][0], abs=1e-3)


@pytest.mark.parametrize("torch_pair", MODELS, indirect=True)
async def test_torch_models_speculate_and_write_the_plain_output(
    torch_pair: tuple[TorchBackend, TorchBackend],
) -> None:
    plain, spec = torch_pair
    stats = _stats(spec)
    for prompt in _prompts():
        want = await greedy(plain, prompt, 40)
        spec.scheduler.clear_prefix_cache()
        _agree_up_to_ties(await greedy(spec, prompt, 40), want)
    assert 0 < stats.accepted_tokens <= stats.draft_tokens
    assert spec.scheduler.cache.pool.used == 0


@pytest.mark.parametrize("pair", [MODELS[1]], indirect=True)
async def test_the_batched_chooser_verifies_drafts_draw_for_draw(
    pair: tuple[TorchBackend, TorchBackend],
) -> None:
    """On the kernels, both backends choosing tokens with the GPU's batched chooser."""
    plain, spec = pair
    for b in pair:
        old = b.scheduler.chooser
        b.scheduler.chooser = TokenChooser(old.eos_ids, old.tokenizer, on_device=True)
    stats = _stats(spec)
    _, repeating = _prompts()
    cases = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.9, seed=1234),
        SamplingParams(temperature=0.7, top_p=0.9, seed=7, logprobs=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
    ]
    for i, sampling in enumerate(cases):
        drafted = stats.draft_tokens
        want = await _run(plain, _job(repeating, f"p{i}", sampling=sampling, max_tokens=40))
        spec.scheduler.clear_prefix_cache()
        got = await _run(spec, _job(repeating, f"s{i}", sampling=sampling, max_tokens=40))
        assert got == want, sampling
        assert stats.draft_tokens > drafted, sampling
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # accepted and rejected drafts
    assert spec.scheduler.cache.pool.used == 0
