"""``DraftPacer`` alone: how many tokens of each offered draft a step verifies, and what it
learns from verified drafts (per sequence and, shared, per match length) and from drafts it
did not verify, checked against the tokens then chosen; ``StepCost``: what draft rows add to
a step, as measured."""

from __future__ import annotations

import random

import pytest

from services.worker.draft_pacing import DraftPacer, DraftRecord
from services.worker.step_cost import Price, StepCost


def decode_step(pacer: DraftPacer, offers: list[tuple[DraftRecord, int, int]]) -> list[int]:
    """A step of ``len(offers)`` decoding sequences, one row and one token each."""
    n = len(offers)
    return pacer.allot(offers, rows=n, tokens=n)


def test_a_row_is_kept_while_its_chance_beats_the_steps_tokens_per_cost() -> None:
    pacer = DraftPacer(4)
    # alone, a fresh 4-gram match (prior 0.8): the plain step is 2.5 + 1 units for 1 token,
    # each draft row a unit for its chance over 1.15 (0.70, 0.56, 0.45, 0.36); tokens per
    # unit with 0-4 rows: 0.29, 0.38, 0.41, 0.415, 0.41: three tokens
    assert decode_step(pacer, [(DraftRecord(), 4, 4)]) == [3]
    assert decode_step(pacer, [(DraftRecord(), 2, 4)]) == [1]  # prior 0.4
    assert decode_step(pacer, [(DraftRecord(), 1, 4)]) == [0]  # prior 0.2: never worth a row
    # beside a stream that offers no draft a fresh match (0.8) is not enough: it needs better
    # odds, which its drafts checked against what it chooses (``settle``) teach it for no row
    assert pacer.allot([(DraftRecord(), 4, 4)] * 3, rows=4, tokens=4) == [0] * 3
    # where every stream offers one, the cost alone decides: at four streams a row is 1 of 6.5
    # units (0.70 tokens for 4 / 6.5 = 0.62 a unit), at sixteen 1 of 18.5 (16 / 18.5 = 0.86)
    assert decode_step(pacer, [(DraftRecord(), 4, 4) for _ in range(4)]) == [1] * 4
    assert decode_step(pacer, [(DraftRecord(), 4, 4) for _ in range(16)]) == [0] * 16
    copying = DraftRecord(estimates={4: 0.95})
    assert decode_step(pacer, [(copying, 4, 4)]) == [4]
    assert decode_step(pacer, [(copying, 4, 4)] * 4) == [3] * 4
    assert decode_step(pacer, [(copying, 4, 4), *[(DraftRecord(), 4, 4)] * 7]) == [2] + [0] * 7
    assert decode_step(pacer, [(copying, 4, 2)]) == [2]  # never more than offered


def test_prompt_rows_cost_without_yielding_tokens() -> None:
    pacer = DraftPacer(4)
    offer = [(DraftRecord(), 4, 4)]
    assert pacer.allot(offer, rows=1, tokens=1) == [3]
    # beside a 64-row prompt chunk the step costs far more than its one token: drafting is
    # nearly free, so the whole draft is worth verifying
    assert pacer.allot(offer, rows=65, tokens=1) == [4]


def test_what_a_match_length_teaches_reaches_every_sequence() -> None:
    pacer = DraftPacer(4)
    for _ in range(20):  # 2-gram matches, always rejected
        pacer.learn(DraftRecord(), 2, 2, 0)
    for _ in range(20):  # 3-gram matches, accepted
        pacer.learn(DraftRecord(), 3, 4, 4)
    fresh = DraftRecord()
    assert pacer.chance(fresh, 2) < 0.2 < 0.9 < pacer.chance(fresh, 3)
    assert decode_step(pacer, [(fresh, 2, 4), (DraftRecord(), 3, 4)]) == [0, 4]
    mine = DraftRecord()
    pacer.learn(mine, 2, 4, 4)  # this sequence's 2-gram drafts are right: its record counts
    assert pacer.chance(mine, 2) > pacer.chance(fresh, 2)


def test_an_unused_length_drifts_back_to_its_prior_to_be_tried_again() -> None:
    pacer = DraftPacer(4)
    for _ in range(40):
        pacer.learn(DraftRecord(), 3, 1, 0)
    low, steps = pacer.shared[3], 0
    while not decode_step(pacer, [(DraftRecord(), 3, 4)])[0] and steps < 10_000:
        steps += 1
    assert low < pacer.shared[3] < pacer.prior[3] and 20 < steps < 2000


def test_a_wholly_rejected_draft_lowers_the_estimate_and_the_cost_decides_the_next() -> None:
    """No rest after a miss: a copying sequence whose draft the model departs from (a rename)
    drafts again the next step, while one whose drafts keep failing stops once its estimate
    no longer pays for a row."""
    pacer = DraftPacer(4)
    copying = DraftRecord(estimates={4: 0.95})
    pacer.learn(copying, 4, 4, 0)  # 0.95 -> 0.665
    assert decode_step(pacer, [(copying, 4, 4)]) == [2]
    failing, drafts = DraftRecord(estimates={4: 0.95}), []
    for _ in range(8):
        [d] = decode_step(pacer, [(failing, 4, 4)])
        drafts.append(d)
        if d:
            pacer.learn(failing, 4, d, 0)
    assert drafts == [4, 2, 1, 0, 0, 0, 0, 0]


def test_a_sequence_that_cannot_draft_a_row_worth_it_is_not_searched() -> None:
    """``hopeless`` agrees with ``allot``: when true, no row of the sequence's is kept (for a
    lone offer at the prior's cost, true exactly when none is), and then every length drifts
    as an unused offer's would."""
    pacer = DraftPacer(4)
    fresh, copying = DraftRecord(), DraftRecord(estimates={4: 0.95})
    for n in (1, 4, 16):
        offers = [(fresh, m, 4) for m in range(1, 5)]
        none_kept = not any(pacer.allot(offers, rows=n, tokens=n))
        # a fresh match (at most 0.8) pays for a row where every stream offers one (four), not
        # at sixteen rows' price
        assert pacer.hopeless(fresh, rows=n, tokens=n) == none_kept == (n == 16)
        # even a copying sequence: a row at 0.95 would not beat 1.15 x 16 / 18.5
        assert pacer.hopeless(copying, rows=n, tokens=n) == (n == 16)
    for _ in range(40):
        pacer.learn(DraftRecord(), 4, 1, 0)
    low = pacer.shared[4]
    assert pacer.hopeless(DraftRecord(), rows=16, tokens=16) and pacer.shared[4] > low


def test_step_cost_is_the_prior_until_a_rows_plain_and_drafted_steps_are_measured() -> None:
    cost = StepCost()
    assert cost.price(4) == Price(StepCost.BASE + 4, ((0, 0.0), (1, 1.0)))  # in units of a row
    cost.observe(0.0060, rows=4, drafted=0)
    price = cost.price(4)  # no draft row measured yet: the prior's share of the plain step
    assert price.plain == 0.006 and price.added(2) == pytest.approx(2 * 0.006 / 6.5)
    cost.observe(0.0084, rows=4, drafted=2)  # two draft rows added 2.4 ms
    price = cost.price(4)
    assert price.added(2) == pytest.approx(0.0024)
    assert price.added(1) == pytest.approx(0.0012)  # between none and two
    assert price.added(5) == pytest.approx(0.0060)  # past two: what each of those two added
    assert cost.price(1).plain == StepCost.BASE + 1  # each row count has its own
    cost.observe(0.0050, rows=1, drafted=3)  # a drafted step with no plain one to set against
    assert cost.price(1).plain == StepCost.BASE + 1


def test_what_each_count_of_draft_rows_adds_is_kept_apart() -> None:
    """The first draft row beside four streams pays a weight pass of its own (the AVX2 GEMMs
    take four activation rows a pass): each count keeps its own time, and past the last count
    measured a row adds what the last two counts' rows did."""
    cost = StepCost()
    for seconds, drafted in [(0.0150, 0), (0.0194, 1), (0.0218, 2), (0.0261, 4)]:
        cost.observe(seconds, rows=4, drafted=drafted)
    price = cost.price(4)
    assert [price.added(d) for d in (1, 2, 3, 4, 6)] == pytest.approx(
        [0.0044, 0.0068, 0.00895, 0.0111, 0.0154]
    )
    assert price.cheapest_row == pytest.approx(0.00215)


def test_a_count_seldom_measured_never_prices_its_rows_above_more_rows() -> None:
    """Medians are pooled where a count's lies above a larger count's (weighted by steps), so a
    count measured once in a slow spell is not refused for good (never chosen, never measured)."""
    cost = StepCost()
    cost.observe(0.015, rows=4, drafted=0)
    cost.observe(0.0376, rows=4, drafted=4)  # once, slow: 22.6 ms
    for _ in range(5):
        cost.observe(0.0329, rows=4, drafted=6)  # 17.9 ms, five times
    price = cost.price(4)
    assert price.added(4) == price.added(6) == pytest.approx((0.0226 + 5 * 0.0179) / 6)


def test_step_cost_takes_medians_so_a_slow_step_moves_it_little() -> None:
    cost = StepCost()
    for seconds in [0.006] * 6 + [0.030]:  # a neighbour took a core for one step
        cost.observe(seconds, rows=4, drafted=0)
    for seconds in [0.0072] * 6 + [0.0400]:
        cost.observe(seconds, rows=4, drafted=1)
    assert cost.price(4).plain == 0.006
    assert cost.price(4).added(1) == pytest.approx(0.0012)


def test_a_plain_step_is_measured_again_among_drafted_ones() -> None:
    """Drafted steps are set against plain ones, which a stream drafting every step would never
    refresh: every ``REFRESH`` drafted steps of a row count, one is plain."""
    pacer = DraftPacer(4)
    copying = [(DraftRecord(estimates={4: 0.95}), 4, 4)]
    pacer.cost.observe(0.006, rows=1, drafted=0)
    for _ in range(StepCost.REFRESH):
        assert decode_step(pacer, copying) == [4]
        pacer.cost.observe(0.008, rows=1, drafted=4)
    assert decode_step(pacer, copying) == [0]
    pacer.cost.observe(0.006, rows=1, drafted=0)
    assert decode_step(pacer, copying) == [4]


def test_a_dear_measured_row_refuses_drafts_the_prior_would_verify() -> None:
    pacer = DraftPacer(4)
    story = [(DraftRecord(estimates={4: 0.85}), 4, 4) for _ in range(4)]
    assert decode_step(pacer, story) == [1] * 4  # prior: 6.5 units, 0.85 * 6.5 > 1.15 * 4
    for _ in range(3):  # measured: a draft row costs a fifth of four rows' step
        pacer.cost.observe(0.0060, rows=4, drafted=0)
        pacer.cost.observe(0.0072, rows=4, drafted=1)
    assert decode_step(pacer, story) == [0] * 4  # 0.85 * 5 < 1.15 * 4
    for _ in range(3):  # cheap rows (a memory-bound step): the whole draft is worth verifying
        pacer.cost.observe(0.0061, rows=1, drafted=0)
        pacer.cost.observe(0.0063, rows=1, drafted=1)
    assert decode_step(pacer, story[:1]) == [4]


def test_rows_whose_first_is_dear_are_verified_when_enough_share_it() -> None:
    pacer = DraftPacer(4)
    for seconds, drafted in [(0.0150, 0), (0.0194, 1), (0.0218, 2), (0.0261, 4)]:
        pacer.cost.observe(seconds, rows=4, drafted=drafted)
    copying, other = (DraftRecord(estimates={4: 0.95}), 4, 1), (DraftRecord(), 1, 1)
    # one token of one stream would pay for the first row, 4.4 ms, alone: 4.83 tokens in
    # 19.4 ms is fewer per second than 4 in 15
    assert decode_step(pacer, [copying, other, other, other]) == [0] * 4
    # four streams' share it: 7.3 in 26.1 ms
    assert decode_step(pacer, [copying] * 4) == [1] * 4


def test_beside_streams_without_drafts_a_row_needs_a_copying_chance_however_cheap() -> None:
    pacer = DraftPacer(4)
    for rows in (1, 4):  # rows cost a thirtieth of a step (torch's fp32 model)
        for _ in range(3):
            pacer.cost.observe(0.090, rows=rows, drafted=0)
            pacer.cost.observe(0.093, rows=rows, drafted=1)
    weak = DraftRecord(estimates=dict.fromkeys(range(1, 5), 0.45))
    # beside a fourth stream that offers none
    assert pacer.allot([(weak, 4, 4)] * 3, rows=4, tokens=4) == [0] * 3
    # a copying sequence's: rows while the chance is above 0.8 (0.9, 0.81, not 0.729)
    copying = DraftRecord(estimates={4: 0.9})
    assert pacer.allot([(copying, 4, 4)] * 3, rows=4, tokens=4) == [2] * 3
    assert pacer.allot([(copying, 4, 4), (weak, 4, 4)], rows=4, tokens=4) == [2, 0]
    # alone (no batch to spread), or where every stream offers one (the batch moves on
    # together): the cost decides, 0.45 ** 3 = 0.09 tokens for a thirtieth of the step paying
    # beside one token, not beside four
    assert decode_step(pacer, [(weak, 4, 4)]) == [3]
    assert decode_step(pacer, [(weak, 4, 4)] * 4) == [2] * 4
    # so whether it drafts depends on the others' offers: it looks for one
    assert not pacer.hopeless(weak, rows=4, tokens=4)


def test_a_row_cost_not_measured_for_a_hundred_plain_steps_is_forgotten() -> None:
    cost = StepCost()
    cost.observe(0.006, rows=1, drafted=0)
    cost.observe(0.106, rows=1, drafted=1)  # measured in a slow spell: drafts look hopeless
    assert cost.price(1).added(1) == pytest.approx(0.1)
    for _ in range(StepCost.STALE):
        cost.observe(0.006, rows=1, drafted=0)
    assert cost.price(1).added(1) == pytest.approx(0.1)
    cost.observe(0.006, rows=1, drafted=0)
    # the prior's share again: drafts are tried and measured
    assert cost.price(1).added(1) == pytest.approx(0.006 / (StepCost.BASE + 1))
    waits = []
    for _ in range(4):  # each time the drafts still lose, it waits twice as long to try again
        cost.observe(0.106, rows=1, drafted=1)
        plain = 0
        while 1 in cost.added:
            cost.observe(0.006, rows=1, drafted=0)
            plain += 1
        waits.append(plain)
    assert waits == [201, 401, 801, 1601]


def test_prices_kept_between_steps_are_what_the_steps_measured_say() -> None:
    """The medians, curves and prices kept between steps are dropped whenever what they derive
    from changes: after every step of a random mix (counts drafted, borrowed, forgotten), each
    count's price equals one derived afresh."""
    rng = random.Random(7)
    cost = StepCost()
    cost.STALE = cost.MAX_STALE = 6  # forgetting, too, within the run
    for _ in range(3000):
        rows = rng.randint(1, 6)
        drafted = rng.choice([0, 0, 0, rng.randint(1, 8)])
        cost.observe(rng.uniform(0.004, 0.02) * rows, rows=rows, drafted=drafted)
        for r in rng.sample(range(1, 8), 3):
            kept = cost.price(r)
            cost.priced, cost.medians, cost.curves = {}, {}, {}
            assert cost.price(r) == kept


def test_a_row_count_never_drafted_takes_the_nearest_measured_row_cost() -> None:
    cost = StepCost()
    for _ in range(3):
        cost.observe(0.0200, rows=4, drafted=0)
        cost.observe(0.0225, rows=4, drafted=1)  # a draft row: 2.5 ms beside four rows
        cost.observe(0.0160, rows=3, drafted=0)  # three rows, never drafted beside
        cost.observe(0.0050, rows=1, drafted=0)
        cost.observe(0.0060, rows=1, drafted=2)  # 0.5 ms a row beside one row
    assert cost.price(4).added(1) == pytest.approx(0.0025)
    price = cost.price(3)
    assert price.plain == 0.016 and price.added(1) == pytest.approx(0.0025)  # not the prior's
    cost.observe(0.0110, rows=2, drafted=0)  # nearer one row's measured cost than four's
    assert cost.price(2).added(1) == pytest.approx(0.0005)
    for _ in range(3):
        cost.observe(0.0300, rows=6, drafted=0)
        cost.observe(0.0340, rows=6, drafted=1)  # 4 ms beside six rows
    cost.observe(0.0250, rows=5, drafted=0)  # as near to four as to six: the larger's
    assert cost.price(5).added(1) == pytest.approx(0.004)
    # no plain step of seven rows either: the prior
    assert cost.price(7) == Price(StepCost.BASE + 7, ((0, 0.0), (1, 1.0)))


def test_an_unverified_draft_is_checked_against_the_tokens_then_chosen() -> None:
    pacer = DraftPacer(4)
    record = DraftRecord(estimates={4: 0.3})
    pacer.shadow(record, 4, [5, 6, 7, 8], at=3)
    pacer.shadow(record, 2, [9], at=3)  # one outstanding at a time: the first is kept
    tokens = [1, 2, 3, 5, 6]
    pacer.settle(record, tokens)  # two tokens chosen so far, both the draft's: learned now
    assert record.shadow == (4, [7, 8], 5)
    assert record.estimates[4] == pytest.approx(1 - 0.7 * 0.7**2)
    pacer.settle(record, tokens)  # nothing new chosen: nothing learned twice
    assert record.estimates[4] == pytest.approx(1 - 0.7 * 0.7**2)
    pacer.settle(record, [*tokens, 7, 8])  # all four matched: four accepted tokens
    assert record.shadow is None and record.estimates[4] == pytest.approx(1 - 0.7 * 0.7**4)
    pacer.shadow(record, 4, [5, 6], at=3)
    pacer.settle(record, [1, 2, 3, 9])  # rejected at once: learned
    assert record.estimates[4] < 0.8


def test_a_rejected_draft_makes_the_sequence_look_again_on_the_next_step() -> None:
    """After the model departs from a copied source, a sequence whose estimate fell under the
    step's bar looks for a draft at once rather than at its next probe, and learns from it as
    its tokens are chosen: copying usually resumes a step or two later."""
    pacer = DraftPacer(4)
    record = DraftRecord(estimates={4: 0.95})
    assert pacer.probing(record, rows=4)  # looks, then waits PROBE steps
    assert not pacer.probing(record, rows=4)
    pacer.learn(record, 4, 3, 1)  # a verified draft, rejected at its second token
    assert pacer.probing(record, rows=4)
    pacer.shadow(record, 4, [5, 6, 7], at=3)
    pacer.settle(record, [1, 2, 3, 9])  # the looked-at draft is rejected too: look again
    assert record.shadow is None and pacer.probing(record, rows=4)
    pacer.learn(record, 4, 2, 2)  # wholly accepted: no hurry
    assert not pacer.probing(record, rows=4)


def test_a_sequence_that_does_not_draft_looks_for_one_every_few_steps() -> None:
    pacer = DraftPacer(4)
    record = DraftRecord()
    looks = [pacer.probing(record, rows=4) for _ in range(3 * DraftPacer.PROBE)]
    assert looks == ([True] + [False] * (DraftPacer.PROBE - 1)) * 3
    # in a step of 256 rows every 64th step: a step looks for about four drafts in all
    looks = [pacer.probing(record, rows=256) for _ in range(128)]
    assert looks == ([True] + [False] * 63) * 2
    pacer.shadow(record, 4, [5], at=0)
    assert not any(pacer.probing(record, rows=1) for _ in range(2 * DraftPacer.PROBE))
