"""``Speculator`` with the planner alone: which rows a draft adds, the blocks it borrows, what
goes back after verification, and how its pacer's verdict sets a draft's length in a step (no
model: a "forward" commits rows, verification is scripted; ``test_draft_pacing`` has the rule
itself)."""

from __future__ import annotations

from typing import Any

import pytest

from services.worker.draft_pacing import DraftRecord
from services.worker.speculation import Speculator
from tests.unit.worker.test_paging import SIZE, planner, seq, step

REPEAT = [1, 2, 3, 4, 5, 6, 7] * 2  # 14 tokens: "7" was followed by "1" before


def decoding(
    prompt: list[int], *, blocks: int = 16, acceptance: float = 0.95, **kw: Any
) -> tuple[Any, Any]:
    """A planner with one sequence whose prompt is read and first token sampled, and whose
    drafts have been accepted with probability ``acceptance`` (0.95: it drafts all it can)."""
    p = planner(blocks, **kw)
    s = seq(prompt, max_new=32)
    s.decoder = object()  # type: ignore[assignment]  # its stream started
    s.pace = DraftRecord(estimates=dict.fromkeys(range(1, 5), acceptance))
    p.pending.append(s)
    step(p, sample=1)  # tokens: REPEAT + [1]; kv_len 14
    s.generated = 1
    return p, s


def test_a_draft_grows_the_decode_row_and_borrows_blocks() -> None:
    p, s = decoding(REPEAT)
    rows = Speculator(4).propose(p.plan(), p, context_length=1024)
    assert rows == [(s, 5)] and s.draft == [2, 3, 4, 5] and s.drafter.matched == 4
    assert len(s.blocks) * SIZE >= s.kv_len + 5  # 19 positions: 3 blocks of 8


def test_rejected_rows_give_their_blocks_back_and_accepted_ones_are_committed() -> None:
    p, s = decoding(REPEAT)
    spec = Speculator(4)
    spec.propose(p.plan(), p, context_length=1024)
    held = p.pool.used
    assert len(s.blocks) == 3
    # the model takes the last token and one draft token, then chooses 9 instead of 3
    p.commit(s, 1)
    s.tokens.append(2)
    p.commit(s, 1)
    s.tokens.append(9)
    spec.verified(s, 1, p)
    assert s.kv_len == 16 and len(s.tokens) == 17 and s.draft == []
    assert len(s.blocks) == 2 and p.pool.used == held - 1  # the third block went back
    assert p.pool.match(s.hashes[:2]) == s.blocks[:2]  # both full blocks are cached: accepted
    assert spec.stats.draft_tokens == 4 and spec.stats.accepted_tokens == 1


def test_a_draft_never_preempts_and_stays_within_limits() -> None:
    p, s = decoding(REPEAT, blocks=2)  # 16 positions: the draft finds no free block
    rows = Speculator(4).propose(p.plan(), p, context_length=1024)
    assert rows == [(s, 2)] and s.draft == [2] and p.preemptions == 0
    p, s = decoding(REPEAT, blocks=3)  # the sequence holds 2
    other = p.cache.allocate()
    p.pool.register(other, b"cached prefix")
    p.pool.release([other])  # the one free block holds a cached prefix: a draft leaves it be
    assert Speculator(4).propose(p.plan(), p, context_length=1024) == [(s, 2)]
    assert p.pool.cached_free == 1
    p, s = decoding(REPEAT, budget=3)  # the step's token budget
    assert Speculator(4).propose(p.plan(), p, context_length=1024) == [(s, 3)]
    p, s = decoding(REPEAT)
    s.max_new = 3  # one token generated: room for one more draft token and the bonus
    assert Speculator(4).propose(p.plan(), p, context_length=1024) == [(s, 2)]
    p, s = decoding(REPEAT)
    assert Speculator(4).propose(p.plan(), p, context_length=17) == [(s, 2)]


def test_prompts_and_unstarted_sequences_do_not_speculate() -> None:
    p = planner(16, budget=1)  # a prompt read one token a step: rows of one, not decoding
    fresh = seq(REPEAT)
    fresh.decoder = object()  # type: ignore[assignment]
    p.pending.append(fresh)
    p.admit()
    assert Speculator(4).propose(p.plan(), p, context_length=1024) == [(fresh, 1)]
    p, s = decoding(REPEAT)
    s.decoder = None  # its stream has not started: its first token is not chosen yet
    assert Speculator(4).propose(p.plan(), p, context_length=1024) == [(s, 1)]


class Grammar:
    """A constraint double that allows only the first ``allowed`` tokens of any draft."""

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed

    def admits(self, draft: list[int]) -> int:
        return min(self.allowed, len(draft))


def test_a_constrained_draft_is_cut_to_what_the_grammar_allows() -> None:
    for allowed, rows in [(4, 5), (2, 3), (0, 1)]:
        p, s = decoding(REPEAT)
        s.constraint = Grammar(allowed)  # a double (decoding() returns Any)
        assert Speculator(4).propose(p.plan(), p, context_length=1024) == [(s, rows)]


def test_the_step_and_the_match_set_the_length() -> None:
    """The pacer sees the batch's sequences, rows and tokens, and each offer's match length."""

    def drafts(estimates: list[dict[int, float]]) -> list[int]:
        p = planner(64 * len(estimates), budget=512, max_batch=len(estimates))
        seqs = [seq([i + 20, *REPEAT], max_new=32) for i in range(len(estimates))]
        p.pending.extend(seqs)
        step(p, sample=1)
        for s, mine in zip(seqs, estimates, strict=True):
            s.decoder, s.generated = object(), 1  # type: ignore[assignment]  # started
            s.pace = DraftRecord(estimates=mine)
        return [n - 1 for _, n in Speculator(4).propose(p.plan(), p, context_length=1024)]

    sure, unsure = dict.fromkeys(range(1, 5), 0.95), dict.fromkeys(range(1, 5), 0.5)
    assert drafts([sure]) == [4] and drafts([unsure]) == [1]
    assert drafts([sure] * 4) == [3] * 4 and drafts([unsure] * 4) == [0] * 4
    assert drafts([sure] + [unsure] * 7) == [2] + [0] * 7
    # "1" ends REPEAT + [1]: the match is the 4-gram "5 6 7 1"; only that length's record counts
    assert drafts([{4: 0.95, 1: 0.1}]) == [4] and drafts([{4: 0.1, 1: 0.95}]) == [0]


def test_a_miss_shortens_the_next_draft_and_hits_lengthen_them() -> None:
    p, s = decoding(REPEAT)
    spec = Speculator(4, max_n=1)  # every draft continues a 1-gram: one estimate to follow
    s.pace = DraftRecord(estimates={1: 0.7})

    def one_step(accept: int, chosen: int) -> int:
        """Plan with drafts; the model keeps ``accept`` draft tokens (-1: all) then chooses
        ``chosen``; return the sequence's rows this step."""
        [(_, n)] = spec.propose(p.plan(), p, context_length=1024)
        drafted = s.draft
        accept = len(drafted) if accept < 0 else accept
        for j in range(accept + 1 if drafted else 1):
            p.commit(s, 1)
            s.tokens.append(drafted[j] if j < accept else chosen)
            s.generated += 1
        if drafted:
            spec.verified(s, accept, p)
        return n

    assert one_step(0, 1) == 3  # two draft tokens (a 0.7 estimate), both rejected: 0.49
    assert one_step(0, 9) == 2  # no rest: "1" matches, so the next step drafts, one token
    assert one_step(0, 1) == 1  # rejected (0.34), and "9" matches nothing: no draft
    widths = [one_step(-1, 5) - 1 for _ in range(5)]  # each accepted in full
    assert widths == [1, 1, 2, 3, 4]  # the estimate climbs with each, up to k
    assert one_step(1, 9) == 5 and one_step(-1, 5) == 3  # a miss after one token: 0.7 again
    assert spec.stats.drafts == 9 and spec.stats.accepted_tokens == 11 + 1 + 2


def test_the_step_cost_learns_from_decode_steps_alone() -> None:
    """``observe`` times the step last proposed: its rows and draft rows, unless it read a
    prompt too (a prompt chunk's rows cost differently, and yield no tokens)."""
    p, s = decoding(REPEAT)
    spec = Speculator(4)
    spec.propose(p.plan(), p, context_length=1024)  # one row and four draft rows
    spec.observe(0.009)
    assert spec.pacer.cost.plain == {} and spec.pacer.cost.added == {}  # nothing to set it against
    s.pace = DraftRecord(estimates=dict.fromkeys(range(1, 5), 0.01))  # no draft: a plain step
    spec.propose(p.plan(), p, context_length=1024)
    spec.observe(0.005)
    assert list(spec.pacer.cost.plain[1]) == [0.005]
    spec.observe(0.007)  # no step proposed since: nothing learned
    assert list(spec.pacer.cost.plain[1]) == [0.005]
    s.pace = DraftRecord(estimates=dict.fromkeys(range(1, 5), 0.95))
    spec.propose(p.plan(), p, context_length=1024)
    spec.observe(0.009)
    assert list(spec.pacer.cost.added[1][4]) == [pytest.approx(0.004)]  # four draft rows
    assert spec.pacer.cost.price(1).added(1) == pytest.approx(0.001)
    fresh = seq([30, *REPEAT])
    p.pending.append(fresh)
    p.admit()
    rows = spec.propose(p.plan(), p, context_length=1024)  # beside a prompt being read
    assert any(n > 1 and not x.draft for x, n in rows)
    spec.observe(0.050)
    assert list(spec.pacer.cost.plain[1]) == [0.005] and 2 not in spec.pacer.cost.plain


def test_a_sequence_given_up_on_drafts_again_once_it_copies() -> None:
    """A sequence whose drafts failed (estimates far below the step's bar) drafts no row, but
    still looks for a draft every few steps and checks it against the tokens it then chooses:
    once it copies, its estimate climbs back and it drafts again, from the next step."""
    p, s = decoding(REPEAT, acceptance=0.1)
    spec = Speculator(4)
    widths = []
    for _step in range(8):
        [(_seq, n)] = spec.propose(p.plan(), p, context_length=1024)
        widths.append(n - 1)
        drafted = s.draft
        for _token in range(len(drafted) + 1):  # the model copies REPEAT's cycle: all accepted
            p.commit(s, 1)
            s.tokens.append(s.tokens[-7])
            s.generated += 1
        if drafted:
            spec.verified(s, len(drafted), p)
    # looked at step 0 ([2, 3, 4, 5]) and learned token by token as they are chosen: 0.1 ->
    # 0.37 the next step, when a row already pays, then 0.78 (a verified token counted too)
    assert widths == [0, 1, 3, 4, 4, 4, 4, 3]  # the last within max_new
    assert spec.stats.draft_tokens == spec.stats.accepted_tokens > 0
