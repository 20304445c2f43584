"""Speculative decoding from prompt-lookup drafts, verified in the step's one forward.

Owns which decoding sequences speculate in a step, the blocks their draft rows borrow, and the
bookkeeping after verification. A speculating sequence contributes ``1 + d`` rows to the step's
forward (its last token and ``d`` drafted ones, ``drafting.NgramIndex``), with logits for all of
them; other sequences' rows share the forward unchanged.

Verification is the per-token path run once per row: the scheduler chooses row ``j``'s token
with ``TokenChooser.row`` after feeding the tokens before it, so the forced marker, penalties,
EOS bans, logprobs and the seeded draw all see exactly the state they would one token at a time
(on a GPU, the batched chooser's counter-based draw for that position). Row ``j + 1`` is only
valid if the token chosen at row ``j`` is the draft's ``j``-th: the first mismatch is the step's
last token (the "bonus" on full acceptance). For greedy choice that is the longest matching
prefix plus the argmax after it; for a draw it is exactly the sequential draw (a deterministic
draft x is accepted with probability p(x), and a rejection yields p with x removed,
renormalized), so the output is the model's, token for token, under either.

How exact depends on the model's rows. The CPU kernels compute each row's logits to the same
bits as a lone decode row (they are batch-invariant), so there the output is the plain output,
bit for bit. Torch's GEMMs (a model off the kernels, a GPU) sum a row differently with the
rows beside it, as they already do when the batch changes: the logits differ in their last
bits, and the chosen token only where two candidates tie within that.

Rollback needs no copy: rows past the accepted ones wrote keys and values at positions past
``kv_len``, which the next step overwrites; blocks wholly past ``kv_len`` go back to the pool.
The prefix cache learns a block only through ``Planner.commit``, called once per accepted row,
so a rejected draft never reaches it (draft blocks are never claimed either).

Structured output speculates too: a draft is first cut to what the grammar allows
(``ConstraintState.admits``), and the masks of its rows are filled beside the forward, row
``j + 1``'s as if the draft's first ``j + 1`` tokens were chosen (llguidance consumes them and
rolls the matcher back, ``Constrainer.begin``); a row is only read while the draft is accepted,
so its mask is the one a one-token step would have used, and the matcher itself only ever
consumes chosen tokens. Not speculated: prompts still being read.

When to draft, and how much, is ``draft_pacing.DraftPacer``'s: each draft row is weighed
against the step it joins, by the draft's estimated chance of acceptance and the row's measured
cost. On a GPU a step with draft rows runs eagerly, not from a replayed decode graph, which the
measured cost charges to the draft rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.draft_pacing import DraftPacer, DraftRecord
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
    """The step's ``logits`` parted: the plain sequences' rows, and each speculating
    sequence's rows (``TokenChooser.row`` chooses from them one at a time)."""
    plain, drafted, at = [], [], 0
    for (seq, _), span in zip(rows, spans, strict=True):
        if seq.draft:
            drafted.append((seq, logits[at : at + span.logits]))
        elif span.logits:
            plain.append(at)
        at += span.logits
    return logits[plain], drafted


class Speculator:
    """Drafts for a step's decoding sequences, and the cleanup once they are verified."""

    def __init__(self, tokens: int, *, max_n: int = 4, min_n: int = 1) -> None:
        if tokens < 1:
            raise ValueError(f"speculation needs at least one draft token, not {tokens}")
        self.k, self.max_n, self.min_n = tokens, max_n, min_n
        self.pacer = DraftPacer(max_n)
        self.stats = SpecStats()
        self._step: tuple[int, int] | None = None  # the decode step proposed: (rows, drafted)

    def propose(self, rows: Rows, planner: Planner, context_length: int) -> Rows:
        """``rows`` with each eligible decoding sequence's row count grown by its draft
        (``seq.draft``), as far as the step gains by it (``DraftPacer.allot``), within the
        step's token budget and the pool's free blocks: a draft never preempts anyone, and
        never outgrows ``max_new`` or the context."""
        offers: list[tuple[SequenceState, list[int]]] = []
        step = {
            "rows": sum(n for _, n in rows),
            "tokens": sum(1 for s, n in rows if s.kv_len + n == len(s.tokens)),
        }
        for seq, n in rows:
            seq.draft = []
            if n != 1 or not self._eligible(seq):
                continue
            record = self._start(seq)
            self.pacer.settle(record, seq.tokens)
            wanted = not self.pacer.hopeless(record, **step)
            if not wanted and not self.pacer.probing(record, rows=step["rows"]):
                continue
            draft = self._draft(seq, context_length)
            if wanted and draft:
                offers.append((seq, draft))
            elif draft:  # not verified: checked against what the sequence chooses instead
                self.pacer.shadow(record, _matched(seq), draft, len(seq.tokens))
        keep = self.pacer.allot([(_record(s), _matched(s), len(d)) for s, d in offers], **step)
        budget = planner.max_batched_tokens - sum(n for _, n in rows)
        for (seq, draft), d in zip(offers, keep, strict=True):
            kept = draft[: min(d, budget)]
            seq.draft = kept[: self._fit(planner, seq, len(kept))]
            budget -= len(seq.draft)
            if not seq.draft:
                self.pacer.shadow(_record(seq), _matched(seq), draft, len(seq.tokens))
        decoding = step["rows"] == step["tokens"] == len(rows)  # no prompt rows in it
        self._step = (len(rows), sum(len(s.draft) for s, _ in rows)) if decoding else None
        return [(s, n + len(s.draft)) for s, n in rows]

    def observe(self, seconds: float) -> None:
        """The step last proposed took ``seconds``: what its rows cost (``StepCost``)."""
        if self._step is not None:
            self.pacer.cost.observe(seconds, *self._step)
            self._step = None

    @staticmethod
    def _eligible(seq: SequenceState) -> bool:
        return seq.decoder is not None and seq.to_compute == 1 and seq.job.speculative

    def _start(self, seq: SequenceState) -> DraftRecord:
        """The sequence's drafting record, made with its n-gram index on its first chance to
        draft."""
        if seq.drafter is None:
            seq.drafter = NgramIndex(self.max_n, self.min_n)
        if seq.pace is None:
            seq.pace = DraftRecord()
        return seq.pace

    def _draft(self, seq: SequenceState, context_length: int) -> list[int]:
        """The sequence's draft: up to ``k`` tokens, within ``max_new`` and the context, cut to
        what its grammar allows."""
        assert seq.drafter is not None
        room = min(
            self.k,
            seq.max_new - seq.generated - 1,  # the bonus token must still be allowed
            context_length - len(seq.tokens) - 1,
        )
        draft = seq.drafter.propose(seq.tokens, room) if room > 0 else []
        if seq.constraint is not None:
            draft = draft[: seq.constraint.admits(draft)]
        return draft

    @staticmethod
    def _fit(planner: Planner, seq: SequenceState, drafted: int) -> int:
        """Blocks for ``drafted`` rows past the decode row, as many as plain free blocks allow
        (a draft, likely partly rejected, never evicts a cached prefix): how many rows fit."""
        size, pool = planner.size, planner.pool
        want = seq.kv_len + 1 + drafted
        while len(seq.blocks) * size < want:
            if pool.free - pool.cached_free < 1:
                return max(0, len(seq.blocks) * size - seq.kv_len - 1)
            planner.cache.extend(seq.blocks)
        return drafted

    def verified(self, seq: SequenceState, accepted: int, planner: Planner) -> None:
        """Account ``seq``'s verified draft (``accepted`` of its tokens chosen) and, if it still
        runs, give back the blocks wholly past its keys and values."""
        self.stats.drafts += 1
        self.stats.draft_tokens += len(seq.draft)
        self.stats.accepted_tokens += accepted
        if seq.draft:
            self.pacer.learn(_record(seq), _matched(seq), len(seq.draft), accepted)
        seq.draft = []
        if seq.done or not seq.blocks:
            return
        keep = -(-seq.kv_len // planner.size)
        if len(seq.blocks) > keep:
            # never registered (only blocks below kv_len are) nor claimed: plain free blocks
            spare = seq.blocks[keep:]
            del seq.blocks[keep:]
            planner.pool.release(spare)


def _record(seq: SequenceState) -> DraftRecord:
    assert seq.pace is not None  # set with the drafter, on the sequence's first chance to draft
    return seq.pace


def _matched(seq: SequenceState) -> int:
    assert seq.drafter is not None
    return seq.drafter.matched
