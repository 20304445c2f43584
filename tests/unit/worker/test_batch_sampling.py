"""The batched token sampler (``batch_sampling``) on CPU tensors: greedy and forced rows, the
filters' supports and the penalties row by row against the per-sequence sampler
(``sampling.py``), EOS bans, logprobs, the counter-based uniforms (``hash_uniform``), seeded draws
that ignore the rest of the batch and follow the filtered softmax. Through the engine:
``test_batch_sampling_engine.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.batch_sampling import (
    GOLDEN,
    MIX1,
    MIX2,
    RowChoice,
    _filtered,
    _penalised,
    choose_tokens,
    hash_uniform,
)
from services.worker.sampling import SamplingConfig, apply_penalties, filter_logits, top_logprobs

torch.set_num_threads(1)

SAMPLED = SamplingConfig(temperature=1.0)
GREEDY = SamplingConfig(temperature=0.0)

# Filter combinations, several per batch: each row must keep what ``filter_logits`` keeps.
CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=5),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=1.0, min_p=0.05),
    SamplingConfig(temperature=0.5, top_k=40, top_p=0.9),
    SamplingConfig(temperature=1.0, top_k=20, min_p=0.1),
    SamplingConfig(temperature=2.0, top_p=0.5, min_p=0.2),
    SamplingConfig(temperature=0.9, top_k=100, top_p=0.95, min_p=0.01),
    SamplingConfig(temperature=1.0, top_k=1),
    SamplingConfig(temperature=1.0, top_p=0.01),
    SamplingConfig(temperature=1.0, top_k=10_000_000),  # wider than the vocabulary: off
]


def _row(cfg: SamplingConfig = SAMPLED, seed: int = 0, counter: int = 0, **kw: object) -> RowChoice:
    return RowChoice(sampling=cfg, seed=seed, counter=counter, **kw)  # type: ignore[arg-type]


def _logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    """Random logits: continuous, so no two entries tie."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _finite(row: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(row.tolist()) if math.isfinite(v)}


def _tokens(logits: torch.Tensor, rows: list[RowChoice], eos: list[int] | None = None) -> list[int]:
    return choose_tokens(logits, rows, eos or [])[0]


def _draws(logits: torch.Tensor, cfg: SamplingConfig, n: int, seed: int = 11) -> list[int]:
    """``n`` seeded draws from one (V,) row, one per counter (position), in one batch."""
    rows = [_row(cfg, seed=seed, counter=c) for c in range(n)]
    return _tokens(logits.expand(n, -1), rows)


# -- greedy and forced ----------------------------------------------------------------------


def test_greedy_rows_take_the_first_maximum_whatever_the_filters() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 5.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    cfg = SamplingConfig(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9)
    assert _tokens(logits, [_row(cfg), _row(GREEDY), _row(GREEDY)]) == [1, 0, 0]
    random = _logits(6, 500, seed=1)
    assert _tokens(random, [_row(GREEDY)] * 6) == random.argmax(-1).tolist()


def test_a_forced_token_wins_over_greedy_draws_and_bans() -> None:
    logits = _logits(3, 50, seed=2)
    rows = [
        _row(GREEDY, forced=7),
        _row(SAMPLED, seed=3, forced=8),
        _row(SamplingConfig(temperature=1.0, top_k=1), forced=2, ban_eos=True),  # 2 is EOS
    ]
    assert _tokens(logits, rows, eos=[2]) == [7, 8, 2]
    free = _tokens(logits, [_row(GREEDY), _row(SAMPLED, seed=3)])
    assert free[0] == int(logits[0].argmax()) != 7  # the override changed something


def test_choose_tokens_leaves_the_logits_untouched() -> None:
    logits = _logits(3, 40, seed=4)
    before = logits.clone()
    counts = torch.ones(40)
    rows = [
        _row(SamplingConfig(temperature=0.0, frequency_penalty=1.0), counts=counts),
        _row(SAMPLED, ban_eos=True),
        _row(GREEDY, ban_eos=True, logprobs=2),
    ]
    choose_tokens(logits, rows, [0, 1])
    assert torch.equal(logits, before)


# -- filters ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("vocab", "scale"), [(384, 1.0), (384, 10.0), (4096, 3.0), (4096, 0.3)])
def test_filtered_keeps_the_support_of_filter_logits_row_by_row(vocab: int, scale: float) -> None:
    """Every config in one batch, twice over in two orders: each row's finite entries are the
    per-sequence filter's, and they hold the same temperature-scaled values."""
    cfg = CONFIGS + CONFIGS[::-1]
    logits = _logits(len(cfg), vocab, seed=vocab + int(scale * 10), scale=scale)
    out = _filtered(logits, cfg)
    for i, c in enumerate(cfg):
        ref = filter_logits(logits[i], c)
        assert _finite(out[i]) == _finite(ref), f"row {i}: {c}"
        kept = torch.isfinite(ref)
        torch.testing.assert_close(out[i][kept], ref[kept])


def test_filtered_with_every_filter_off_only_scales() -> None:
    logits = _logits(2, 30, seed=5)
    cfg = [SamplingConfig(temperature=2.0), SamplingConfig(temperature=0.5, top_k=30)]
    torch.testing.assert_close(_filtered(logits, cfg), logits / torch.tensor([[2.0], [0.5]]))


def test_top_p_off_keeps_the_long_tail_beside_a_filtered_row() -> None:
    """A peaked row whose fp32 cumulative sum reaches 1.0 long before its last token: top_p
    1.0 (off) keeps every token although another row of the batch is filtered."""
    logits = _logits(2, 2048, seed=6, scale=10.0)
    out = _filtered(logits, [SamplingConfig(top_k=3), SamplingConfig(temperature=1.0)])
    assert len(_finite(out[0])) == 3
    assert _finite(out[1]) == set(range(2048))


# -- penalties ---------------------------------------------------------------------------------


def test_penalised_equals_apply_penalties_row_by_row() -> None:
    vocab = 64
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, vocab, generator=gen) * 3
    counts = torch.randint(0, 4, (vocab,), generator=gen).float()
    seen = (torch.rand(vocab, generator=gen) < 0.4) | (counts > 0)
    rows = [
        _row(SamplingConfig(presence_penalty=0.5), counts=counts),
        _row(SamplingConfig(frequency_penalty=0.75), counts=counts),
        _row(SamplingConfig(repetition_penalty=1.5), seen=seen),
        _row(
            SamplingConfig(presence_penalty=1.0, frequency_penalty=0.25, repetition_penalty=2.0),
            counts=counts,
            seen=seen,
        ),
        _row(
            SamplingConfig(repetition_penalty=0.8, presence_penalty=-0.5), counts=counts, seen=seen
        ),
        _row(SamplingConfig(), counts=counts, seen=seen),  # state but no penalty
    ]
    out = _penalised(logits, rows)
    zeros = torch.zeros(vocab)
    for i, r in enumerate(rows):
        c = r.counts if r.counts is not None else zeros
        s = r.seen if r.seen is not None else zeros.bool()
        ref = apply_penalties(logits[i], c, s, r.sampling)
        torch.testing.assert_close(out[i], ref, rtol=1e-6, atol=1e-6)
        if r.sampling != SamplingConfig():
            assert not torch.equal(out[i], logits[i]), f"row {i} was not penalised"


def test_penalties_apply_only_to_rows_with_state() -> None:
    """Greedy rows through ``choose_tokens``: a penalised row takes the argmax of the penalised
    logits, its neighbours without counts or seen the argmax of their own."""
    logits = torch.tensor([[4.0, 3.0, 1.0], [4.0, 3.0, 1.0], [4.0, 3.0, 1.0]])
    heavy = SamplingConfig(temperature=0.0, frequency_penalty=2.0, repetition_penalty=4.0)
    counts = torch.tensor([1.0, 0.0, 0.0])
    seen = torch.tensor([True, False, False])
    rows = [_row(heavy, counts=counts, seen=seen), _row(heavy), _row(GREEDY)]
    assert _tokens(logits, rows) == [1, 0, 0]  # 4 -> 4 / 4 - 2 = -1


# -- EOS bans --------------------------------------------------------------------------------------


def test_ban_eos_makes_eos_impossible_even_as_the_argmax() -> None:
    logits = _logits(4, 20, seed=9)
    logits[:, 5] = 100.0  # EOS is everyone's argmax
    logits[:, 6] = 99.0  # and the other EOS id next
    rows = [
        _row(GREEDY, ban_eos=True),
        _row(GREEDY),
        _row(SAMPLED, seed=1, ban_eos=True),
        _row(SAMPLED, seed=1),
    ]
    eos = [5, 6, 10_000]  # an id past the vocabulary is ignored
    tokens = _tokens(logits, rows, eos)
    rest = logits[0].clone()
    rest[[5, 6]] = float("-inf")
    assert tokens[0] == int(rest.argmax())
    assert tokens[1] == 5 and tokens[3] == 5
    assert tokens[2] not in (5, 6)
    banned = [_row(SAMPLED, seed=2, counter=c, ban_eos=True) for c in range(2000)]
    drawn = _tokens(_logits(1, 20, seed=9, scale=0.1).expand(2000, -1), banned, [5, 6])
    assert not {5, 6} & set(drawn) and len(set(drawn)) == 18  # every other token turns up


# Where splitmix64's top 24 bits of (seed 7, counter 37928, token 4) are all ones: their fp32
# uniform was 1.0, an exponential of 0 that a token of probability 0 won (0 / 0 = NaN).
EXTREME = (7, 37928, 4)


def test_a_banned_or_filtered_token_is_not_drawn_at_the_extreme_uniform() -> None:
    seed, counter, token = EXTREME
    u = hash_uniform(torch.tensor([seed]), torch.tensor([counter]), 8)[0, token]
    assert 1 - 2**-20 < float(u) < 1.0
    logits = torch.zeros(1, 8)
    assert _tokens(logits, [_row(SAMPLED, seed, counter, ban_eos=True)], [token]) != [token]
    logits[0, token] = -100.0  # outside top_k = 7
    assert _tokens(logits, [_row(SamplingConfig(top_k=7), seed, counter)]) != [token]
    logits[0, token] = float("-inf")  # masked (as a grammar masks)
    assert _tokens(logits, [_row(SAMPLED, seed, counter)]) != [token]


# -- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_read_off_the_raw_logits() -> None:
    """Rows that ask get ``top_logprobs`` of their raw row at the chosen token (chosen after
    penalties and bans); the others get None; k = 0 gives no alternatives."""
    vocab = 100
    logits = _logits(6, vocab, seed=12)
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[int(logits[1].argmax())] = True
    rows = [
        _row(GREEDY, logprobs=3),
        _row(SamplingConfig(temperature=0.0, repetition_penalty=100.0), seen=seen, logprobs=5),
        _row(SAMPLED, seed=4, counter=2, logprobs=0),
        _row(SAMPLED, seed=4, counter=3),
        _row(SamplingConfig(temperature=0.8, top_p=0.9), seed=5, ban_eos=True, logprobs=20),
        _row(GREEDY, forced=17, logprobs=1),
    ]
    tokens, logprobs = choose_tokens(logits, rows, [int(logits[4].argmax())])
    assert tokens[1] != int(logits[1].argmax())  # the penalty moved the choice
    assert logprobs[3] is None
    for i, r in enumerate(rows):
        got = logprobs[i]
        if r.logprobs < 0:
            continue
        assert got is not None
        lp, top = top_logprobs(logits[i], tokens[i], r.logprobs)
        assert got[0] == pytest.approx(lp, abs=1e-6)
        assert [t for t, _ in got[1]] == [t for t, _ in top]
        assert [v for _, v in got[1]] == pytest.approx([v for _, v in top], abs=1e-6)
    assert logprobs[2] is not None and logprobs[2][1] == []
    assert logprobs[4] is not None and len(logprobs[4][1]) == 20


def test_no_row_asking_for_logprobs_gives_nones() -> None:
    tokens, logprobs = choose_tokens(_logits(3, 10), [_row(GREEDY)] * 3, [])
    assert len(tokens) == 3 and logprobs == [None, None, None]


# -- hash_uniform --------------------------------------------------------------------------------


def _splitmix(seed: int, counter: int, token: int) -> float:
    """The uniform by its definition, in Python integers modulo 2^64."""
    mask = (1 << 64) - 1
    x = (seed * GOLDEN + counter * MIX2 + token * MIX1) & mask
    x = ((x ^ (x >> 30)) * MIX1) & mask
    x = ((x ^ (x >> 27)) * MIX2) & mask
    x ^= x >> 31
    return ((x >> 41) + 0.5) / (1 << 23)


def test_hash_uniform_is_splitmix64_by_its_definition() -> None:
    seeds = [0, 1, 7, -1, 2**62 + 12345, -(2**63)]
    counters = [0, 1, 37928, 5, 2**40, 3]
    u = hash_uniform(torch.tensor(seeds), torch.tensor(counters), 16)
    for i, (s, c) in enumerate(zip(seeds, counters, strict=True)):
        assert u[i].tolist() == [_splitmix(s, c, t) for t in range(16)]


def test_hash_uniform_is_deterministic_and_keyed() -> None:
    seeds, counters = torch.tensor([1, 2, 1, 1]), torch.tensor([0, 0, 1, 0])
    u = hash_uniform(seeds, counters, 64)
    assert torch.equal(u, hash_uniform(seeds, counters, 64))
    assert torch.equal(u[0], u[3])  # same key, same row, wherever it sits in the batch
    assert torch.equal(u[1:2], hash_uniform(seeds[1:2], counters[1:2], 64))
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert len(set(u[0].tolist())) == 64  # tokens differ within a row too


def test_hash_uniform_is_inside_the_open_interval_and_roughly_uniform() -> None:
    """100k values: strictly inside (0, 1), mean near 0.5 and ten equal bins near 10k each."""
    u = hash_uniform(torch.arange(100) * 1_000_003 - 50, torch.arange(100) % 7, 1000).flatten()
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    bins = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(bins.min()) > 9_500 and float(bins.max()) < 10_500


@pytest.mark.parametrize(("big", "small"), [(2**64 - 1, -1), (2**63, -(2**63)), (2**64 - 7, -7)])
def test_seeds_outside_int64_draw_as_their_64_bits(big: int, small: int) -> None:
    """A request's seed is any 64-bit value: drawn as its two's-complement int64."""
    logits = _logits(1, 300, seed=13, scale=0.5).expand(50, -1)
    cfg = SamplingConfig(temperature=0.8, top_p=0.9)

    def draws(seed: int) -> list[int]:
        return _tokens(logits, [_row(cfg, seed=seed, counter=c) for c in range(50)])

    assert draws(big) == draws(small)
    assert draws(big) != draws(small + 1)


# -- seeded draws --------------------------------------------------------------------------------


def test_a_draw_depends_on_its_seed_and_counter_not_on_the_batch() -> None:
    vocab = 200
    logits = _logits(8, vocab, seed=14, scale=1.0)
    rows = [_row(CONFIGS[i % 8], seed=100 + i, counter=i * 3) for i in range(8)]
    rows[5] = _row(GREEDY)
    together = _tokens(logits, rows)
    alone = [_tokens(logits[i : i + 1], [r])[0] for i, r in enumerate(rows)]
    assert together == alone
    order = [7, 2, 5, 0, 3, 6, 1, 4]
    assert _tokens(logits[order], [rows[i] for i in order]) == [together[i] for i in order]
    extra = _logits(3, vocab, seed=15)
    mixed = torch.cat([extra[:2], logits, extra[2:]])
    more = [_row(SAMPLED, seed=1), _row(GREEDY), *rows, _row(SAMPLED, seed=2, ban_eos=True)]
    assert _tokens(mixed, more, [0])[2:-1] == together
    assert len(set(_draws(logits[0], SAMPLED, 20))) > 1  # counters give fresh draws


PROBS = [0.4, 0.25, 0.15, 0.1, 0.07, 0.03]


def _chi_square(drawn: list[int], probs: list[float]) -> float:
    n = len(drawn)
    counts: list[int] = torch.bincount(torch.tensor(drawn), minlength=len(probs)).tolist()
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def _softmax(logits: list[float]) -> list[float]:
    return torch.softmax(torch.tensor(logits, dtype=torch.float64), -1).tolist()


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (SamplingConfig(temperature=1.0), PROBS),
        (SamplingConfig(temperature=0.5), _softmax([2 * math.log(p) for p in PROBS])),
        (SamplingConfig(temperature=1.0, top_k=3), [p / 0.8 for p in PROBS[:3]] + [0.0] * 3),
    ],
)
def test_draws_follow_the_filtered_softmax(cfg: SamplingConfig, expected: list[float]) -> None:
    """4000 draws over a 6-token vocabulary: chi-square against the expected probabilities
    below 30 (5 degrees of freedom: p < 1e-5 for a correct sampler), no excluded token."""
    drawn = _draws(torch.log(torch.tensor(PROBS)), cfg, 4000)
    support = [i for i, p in enumerate(expected) if p > 0]
    assert set(drawn) == set(support)
    assert _chi_square(drawn, [expected[i] for i in support]) < 30.0


def test_draws_stay_inside_top_k_top_p_and_min_p() -> None:
    logits = torch.log(torch.tensor(PROBS))
    assert set(_draws(logits, SamplingConfig(top_k=2), 2000)) == {0, 1}
    assert set(_draws(logits, SamplingConfig(top_p=0.6), 2000)) == {0, 1}  # 0.4 < 0.6 <= 0.65
    assert set(_draws(logits, SamplingConfig(min_p=0.3), 2000)) == {0, 1, 2}  # >= 0.12
    wide = _logits(1, 1000, seed=16, scale=2.0)[0]
    for cfg in CONFIGS:
        support = _finite(filter_logits(wide, cfg))
        drawn = set(_draws(wide, cfg, 1000, seed=17))
        assert drawn <= support, cfg
        assert len(drawn) > 1 or len(support) == 1
