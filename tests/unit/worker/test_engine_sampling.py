"""Sampling functions: greedy, seeded determinism, top-k/top-p/min-p supports, penalties, masks."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.sampling import (
    SamplingConfig,
    apply_penalties,
    filter_logits,
    mask_tokens,
    sample_next_token,
    top_logprobs,
)

torch.set_num_threads(1)

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]))


def _support(cfg: SamplingConfig, logits: torch.Tensor = LOGITS) -> set[int]:
    return {i for i, v in enumerate(filter_logits(logits, cfg).tolist()) if math.isfinite(v)}


def test_greedy_is_argmax_regardless_of_filters() -> None:
    cfg = SamplingConfig(temperature=0.0, top_k=3, top_p=0.1)
    assert sample_next_token(torch.tensor([0.1, 3.0, 2.9]), cfg, None) == 1


def test_seeded_draws_are_reproducible_and_seed_dependent() -> None:
    cfg = SamplingConfig(temperature=1.0)
    logits = torch.zeros(50)

    def draws(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sample_next_token(logits, cfg, gen) for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_top_k_keeps_k_best() -> None:
    assert _support(SamplingConfig(top_k=2)) == {0, 1}
    assert _support(SamplingConfig(top_k=0)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    assert _support(SamplingConfig(top_p=0.5)) == {0}
    assert _support(SamplingConfig(top_p=0.6)) == {0, 1}
    assert _support(SamplingConfig(top_p=0.75)) == {0, 1}
    assert _support(SamplingConfig(top_p=0.8)) == {0, 1, 2}
    assert _support(SamplingConfig(top_p=0.01)) == {0}  # the best token always survives


def _nucleus_by_sorting(logits: torch.Tensor, top_p: float) -> set[int]:
    """The top_p definition, over the whole vocabulary sorted (the same fp32 probabilities)."""
    probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
    before = torch.cumsum(probs, -1) - probs
    return {int(i) for i in order[before < top_p]}


@pytest.mark.parametrize("width", [0.5, 3.0, 30.0])  # peaked to flat: nuclei of 1 to ~40k tokens
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_on_a_large_vocabulary_equals_sorting_everything(width: float, top_p: float) -> None:
    """The nucleus is found from the best 64, then 1024, then all tokens: the same set as a sort
    of the whole vocabulary."""
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(7)) / width * 10
    assert _support(SamplingConfig(top_p=top_p), logits) == _nucleus_by_sorting(logits, top_p)


def test_draws_follow_the_distribution() -> None:
    """Inverting the cumulative sum: frequencies over 20k seeded draws within 0.02 of each
    probability, and a zero-probability token (even the first) never drawn."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(3)
    cfg = SamplingConfig(temperature=1.0)
    counts = torch.bincount(
        torch.tensor([sample_next_token(probs.log(), cfg, gen) for _ in range(20_000)]),
        minlength=6,
    )
    assert counts[[0, 2, 5]].sum() == 0
    assert (counts / 20_000 - probs).abs().max() < 0.02


def test_min_p_is_relative_to_the_best_token() -> None:
    assert _support(SamplingConfig(min_p=0.5)) == {0, 1}
    assert _support(SamplingConfig(min_p=0.2)) == {0, 1, 2}


def test_samples_stay_inside_the_support() -> None:
    gen = torch.Generator().manual_seed(0)
    cfg = SamplingConfig(temperature=1.0, top_k=3, top_p=0.7)
    seen = {sample_next_token(LOGITS, cfg, gen) for _ in range(200)}
    assert seen == {0, 1}


def test_temperature_flattens_or_sharpens() -> None:
    hot = torch.softmax(filter_logits(LOGITS, SamplingConfig(temperature=2.0)), -1)
    cold = torch.softmax(filter_logits(LOGITS, SamplingConfig(temperature=0.5)), -1)
    assert hot[0] < 0.5 < cold[0]


def test_penalties() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    counts = torch.tensor([3.0, 1.0, 0.0, 0.0])
    seen = torch.tensor([True, True, True, False])
    out = apply_penalties(logits, counts, seen, SamplingConfig(frequency_penalty=0.5))
    assert out.tolist() == [0.5, -2.5, 1.0, 0.5]
    out = apply_penalties(logits, counts, seen, SamplingConfig(presence_penalty=1.0))
    assert out.tolist() == [1.0, -3.0, 1.0, 0.5]
    out = apply_penalties(logits, counts, seen, SamplingConfig(repetition_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 0.5, 0.5]  # prompt tokens count as seen; 3 unseen
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # pure: input untouched


def test_mask_tokens_bans_eos() -> None:
    logits = torch.tensor([1.0, 5.0, 2.0])
    assert sample_next_token(mask_tokens(logits, [1]), SamplingConfig(temperature=0), None) == 2
    assert mask_tokens(logits, []) is logits


def test_top_logprobs() -> None:
    lp, top = top_logprobs(LOGITS, 2, 2)
    assert math.isclose(lp, math.log(0.125), rel_tol=1e-5)
    assert [i for i, _ in top] == [0, 1]
    assert math.isclose(top[0][1], math.log(0.5), rel_tol=1e-5)
