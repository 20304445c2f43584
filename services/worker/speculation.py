"""Speculative decoding from prompt-lookup drafts, verified in the step's one forward.

Owns which decoding sequences speculate in a step, the blocks their draft rows borrow, and the
bookkeeping after verification. A speculating sequence contributes ``1 + d`` rows to the step's
forward (its last token and ``d`` drafted ones, ``drafting.NgramIndex``), with logits for all of
them; other sequences' rows share the forward unchanged.

Verification is the per-token path run once per row: the scheduler chooses row ``j``'s token
with ``TokenChooser.one`` after feeding the tokens before it, so the forced marker, penalties,
EOS bans, logprobs and the seeded draw all see exactly the state they would one token at a time,
and the kernels compute each row's logits to the same bits as a lone decode row would. Row
``j + 1`` is only valid if the token chosen at row ``j`` is the draft's ``j``-th: the first
mismatch is the step's last token (the "bonus" on full acceptance). For greedy choice that is
the longest matching prefix plus the argmax after it; for a draw it is exactly the sequential
draw (a deterministic draft x is accepted with probability p(x), and a rejection yields p with x
removed, renormalized), so the output is the model's, token for token, under either.

Rollback needs no copy: rows past the accepted ones wrote keys and values at positions past
``kv_len``, which the next step overwrites; blocks wholly past ``kv_len`` go back to the pool.
The prefix cache learns a block only through ``Planner.commit``, called once per accepted row,
so a rejected draft never reaches it (draft blocks are never claimed either).

Structured output speculates too: a draft is first cut to what the grammar allows
(``ConstraintState.admits``), and the masks of its rows are filled beside the forward, row
``j + 1``'s as if the draft's first ``j + 1`` tokens were chosen (llguidance consumes them and
rolls the matcher back, ``Constrainer.begin``); a row is only read while the draft is accepted,
so its mask is the one a one-token step would have used, and the matcher itself only ever
consumes chosen tokens. Not speculated: prompts still being read, and the GPU path (its batched
chooser and replayed decode graphs take one row per sequence).

When to draft, and how much, weighs each draft row against the step it joins (``Speculator``'s
``allot``): on the CPU kernels a row costs about a quarter of a one-row step, so a row is worth
adding only while its draft token's chance of acceptance beats the tokens per unit of cost the
step already yields, a bar that rises with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.drafting import NgramIndex
from services.worker.kv_cache import SeqRows
from services.worker.paging import Planner
from services.worker.sequence import SequenceState

__all__ = ["SpecStats", "Speculator", "forward_rows", "split_logits"]


@dataclass
class SpecStats:
    """Counters with vLLM's meaning (``spec_decode_num_draft_tokens`` and the rest)."""

    drafts: int = 0  # verification rounds: steps in which a sequence speculated
    draft_tokens: int = 0  # tokens proposed and verified
    accepted_tokens: int = 0  # of those, tokens the model itself chose


Rows = list[tuple[SequenceState, int]]


def forward_rows(rows: Rows) -> tuple[list[SeqRows], list[int]]:
    """A step's spans and token ids: a sequence's ``n`` new tokens (logits for the last when
    they complete what it knows), or its last token and its draft (logits for each)."""
    spans, ids = [], []
    for s, n in rows:
        if s.draft:
            spans.append(SeqRows(s.key, s.blocks, s.kv_len, n, n))
            ids.extend([s.tokens[s.kv_len], *s.draft])
        else:
            spans.append(SeqRows(s.key, s.blocks, s.kv_len, n, int(s.kv_len + n == len(s.tokens))))
            ids.extend(s.tokens[s.kv_len : s.kv_len + n])
    return spans, ids


def split_logits(
    rows: Rows, spans: list[SeqRows], logits: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[SequenceState, torch.Tensor]]]:
    """The step's ``logits`` parted: the plain sequences' rows (on their device), and each
    speculating sequence's rows (in host memory, where ``TokenChooser.one`` reads them)."""
    host, plain, drafted, at = logits.cpu(), [], [], 0
    for (seq, _), span in zip(rows, spans, strict=True):
        if seq.draft:
            drafted.append((seq, host[at : at + span.logits]))
        elif span.logits:
            plain.append(at)
        at += span.logits
    return logits[plain], drafted


class Speculator:
    """Drafts for a step's decoding sequences, and the cleanup once they are verified."""

    # A CPU step's cost in units of one more token row: BASE + PER_SEQ * sequences + rows, the
    # marginal costs of small batches on the default model (ops/bench/row_cost.py: SmolLM2-135M
    # Q4_1, 2 threads, 400-token contexts; one row 5.5 ms, one sequence's 5 rows 9.7 ms, 4
    # sequences' single rows 10.8 ms). Larger batches' rows cost less than this (4 sequences'
    # 5 rows: 22.9 ms), so there the bar errs on drafting too little, never too much.
    BASE, PER_SEQ = 3.7, 0.7
    PRIOR = 0.5  # a fresh sequence's acceptance estimate: one draft token likely, four not
    RATE = 0.3  # weight of the latest verified token in a sequence's estimate
    MAX_REST = 31  # steps a sequence rests, at most, after drafts that did not pay

    def __init__(self, tokens: int, *, max_n: int = 4, min_n: int = 1) -> None:
        if tokens < 1:
            raise ValueError(f"speculation needs at least one draft token, not {tokens}")
        self.k, self.max_n, self.min_n = tokens, max_n, min_n
        self.stats = SpecStats()

    def propose(self, rows: Rows, planner: Planner, context_length: int) -> Rows:
        """``rows`` with each eligible decoding sequence's row count grown by its draft
        (``seq.draft``), as far as the step gains by it (``allot``), within the step's token
        budget and the pool's free blocks: a draft never preempts anyone, and never outgrows
        ``max_new`` or the context."""
        offers: list[tuple[SequenceState, list[int]]] = []
        for seq, n in rows:
            seq.draft = []
            if n == 1 and self._eligible(seq) and self._due(seq):
                assert seq.drafter is not None
                room = min(
                    self.k,
                    seq.max_new - seq.generated - 1,  # the bonus token must still be allowed
                    context_length - len(seq.tokens) - 1,
                )
                draft = seq.drafter.propose(seq.tokens, room) if room > 0 else []
                if seq.constraint is not None:
                    draft = draft[: seq.constraint.admits(draft)]
                if draft:
                    offers.append((seq, draft))
        budget = planner.max_batched_tokens - sum(n for _, n in rows)
        keep = self.allot(offers, rows)
        for (seq, draft), d in zip(offers, keep, strict=True):
            if d == 0:  # not worth a row in this batch: ask again after a rest
                self._rest(seq)
                continue
            draft = draft[: min(d, budget)]
            seq.draft = draft[: self._fit(planner, seq, len(draft))]
            budget -= len(seq.draft)
        return [(s, n + len(s.draft)) for s, n in rows]

    def allot(self, offers: list[tuple[SequenceState, list[int]]], rows: Rows) -> list[int]:
        """How many tokens of each offered draft the step verifies.

        Draft token ``j`` of a sequence whose tokens are accepted with estimated probability
        ``a`` is accepted with probability ``a ** j``: that is what its row adds to the step's
        expected tokens, for one unit of cost (``BASE``). A step yielding ``T`` tokens for cost
        ``C`` yields more per unit of time with the row only if ``a ** j > T / C``; rows are
        added best first while that holds, so a large batch (high ``T / C``) keeps only drafts
        likely to be accepted, and a lone stream drafts on weaker evidence.
        """
        tokens = float(sum(1 for s, n in rows if s.kv_len + n == len(s.tokens)))
        cost = self.BASE + self.PER_SEQ * len(rows) + sum(n for _, n in rows)
        chances: list[tuple[float, int]] = []  # (a draft token's chance, its offer)
        for i, (seq, draft) in enumerate(offers):
            assert seq.drafter is not None
            a = seq.drafter.acceptance
            chances.extend((a ** (j + 1), i) for j in range(len(draft)))
        keep = [0] * len(offers)
        for chance, i in sorted(chances, key=lambda c: -c[0]):
            if chance * cost <= tokens:
                break
            keep[i] += 1
            tokens, cost = tokens + chance, cost + 1
        return keep

    @staticmethod
    def _eligible(seq: SequenceState) -> bool:
        return seq.decoder is not None and seq.to_compute == 1

    def _due(self, seq: SequenceState) -> bool:
        """Whether ``seq`` may draft this step (it rests after drafts that did not pay; its
        estimate then drifts halfway back to the prior, so it is tried again)."""
        if seq.drafter is None:
            seq.drafter = NgramIndex(self.max_n, self.min_n)
            seq.drafter.acceptance = self.PRIOR
        drafter = seq.drafter
        if drafter.rest > 0:
            drafter.rest -= 1
            if drafter.rest == 0:
                drafter.acceptance = max(drafter.acceptance, (drafter.acceptance + self.PRIOR) / 2)
            return False
        return True

    def _rest(self, seq: SequenceState) -> None:
        """Rest ``seq`` 1, 3, 7 .. ``MAX_REST`` steps after as many misses in a row."""
        drafter = seq.drafter
        assert drafter is not None
        drafter.misses += 1
        drafter.rest = min(2**drafter.misses - 1, self.MAX_REST)

    @staticmethod
    def _fit(planner: Planner, seq: SequenceState, drafted: int) -> int:
        """Blocks for ``drafted`` rows past the decode row, as many as plain free blocks allow
        (a draft, likely partly rejected, never evicts a cached prefix): how many rows fit."""
        size, pool = planner.size, planner.pool
        want = seq.kv_len + 1 + drafted
        while len(seq.blocks) * size < want:
            if pool.free - pool.cached_free < 1:
                return max(0, len(seq.blocks) * size - seq.kv_len - 1)
            seq.blocks.append(planner.cache.allocate())
        return drafted

    def verified(self, seq: SequenceState, accepted: int, planner: Planner) -> None:
        """Account ``seq``'s verified draft (``accepted`` of its tokens chosen) and, if it still
        runs, give back the blocks wholly past its keys and values."""
        self.stats.drafts += 1
        self.stats.draft_tokens += len(seq.draft)
        self.stats.accepted_tokens += accepted
        self._pace(seq, accepted)
        seq.draft = []
        if seq.done or not seq.blocks:
            return
        keep = -(-seq.kv_len // planner.size)
        if len(seq.blocks) > keep:
            # never registered (only blocks below kv_len are) nor claimed: plain free blocks
            spare = seq.blocks[keep:]
            del seq.blocks[keep:]
            planner.pool.release(spare)

    def _pace(self, seq: SequenceState, accepted: int) -> None:
        """Learn from how ``seq``'s draft fared: each verified token (the accepted ones, and
        the first rejected) moves its acceptance estimate, and a wholly rejected draft makes it
        rest, longer after each such draft in a row. Fresh text (a story) repeats little, though
        some earlier token nearly always matches its last: its drafts then cost rows for
        nothing, so they thin out fast; a copy keeps a high estimate and long drafts."""
        drafter = seq.drafter
        if drafter is None or not seq.draft:
            return
        outcomes = [1.0] * accepted + ([0.0] if accepted < len(seq.draft) else [])
        for x in outcomes:
            drafter.acceptance += self.RATE * (x - drafter.acceptance)
        if accepted:
            drafter.misses = 0
        else:
            self._rest(seq)
