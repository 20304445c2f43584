"""``Speculator`` with the planner alone: which rows a draft adds, the blocks it borrows, and what
goes back after verification (no model: a "forward" commits rows, verification is scripted)."""

from __future__ import annotations

from typing import Any

from services.worker.speculation import Speculator
from tests.unit.worker.test_paging import SIZE, planner, seq, step

REPEAT = [1, 2, 3, 4, 5, 6, 7] * 2  # 14 tokens: "7" was followed by "1" before


def decoding(prompt: list[int], *, blocks: int = 16, **kw: Any) -> tuple[Any, Any]:
    """A planner with one sequence whose prompt is read and first token sampled."""
    p = planner(blocks, **kw)
    s = seq(prompt, max_new=32)
    s.decoder = object()  # type: ignore[assignment]  # its stream started
    p.pending.append(s)
    step(p, sample=1)  # tokens: REPEAT + [1]; kv_len 14
    s.generated = 1
    return p, s


def test_a_draft_grows_the_decode_row_and_borrows_blocks() -> None:
    p, s = decoding(REPEAT)
    rows = Speculator(4).propose(p.plan(), p, context_length=1024)
    assert rows == [(s, 5)] and s.draft == [2, 3, 4, 5]
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


def test_prompts_and_constrained_or_unstarted_sequences_do_not_speculate() -> None:
    p, s = decoding(REPEAT)
    s.constraint = object()
    assert Speculator(4).propose(p.plan(), p, context_length=1024) == [(s, 1)]
    p = planner(16, budget=1)  # a prompt read one token a step: rows of one, not decoding
    fresh = seq(REPEAT)
    fresh.decoder = object()  # type: ignore[assignment]
    p.pending.append(fresh)
    p.admit()
    assert Speculator(4).propose(p.plan(), p, context_length=1024) == [(fresh, 1)]


def test_rejected_drafts_make_a_sequence_rest_and_accepted_ones_lengthen_the_next() -> None:
    p, s = decoding(REPEAT)
    spec = Speculator(4)

    def one_step(accept: int, chosen: int) -> int:
        """Plan with drafts; the model keeps ``accept`` draft tokens then chooses ``chosen``;
        return the sequence's rows this step."""
        [(_, n)] = spec.propose(p.plan(), p, context_length=1024)
        drafted = s.draft
        for j in range(accept + 1 if drafted else 1):
            p.commit(s, 1)
            s.tokens.append(drafted[j] if j < accept else chosen)
            s.generated += 1
        if drafted:
            spec.verified(s, accept, p)
        return n

    assert one_step(0, 9) == 5  # drafted 4, all rejected
    assert one_step(0, 1) == 1  # rests one step
    assert one_step(1, 3) == 2  # then drafts one token past what was accepted: 1
    assert one_step(2, 5) == 3  # that was accepted in full: twice as long next time
    assert one_step(0, 9) == 5  # and again, up to k
    assert [one_step(0, 1), one_step(0, 9)] == [1, 2]  # rests, drafts 1, a second miss...
    assert [one_step(0, 1) for _ in range(3)] == [1, 1, 1]  # ... in a row: rests 3
    assert one_step(0, 9) == 2
