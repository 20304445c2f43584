"""When a speculating sequence drafts, and how many tokens: the speculator's pacing.

Owns ``DraftPacer`` (one per speculator: the step cost model, and the acceptance learned per
match length across sequences) and ``DraftRecord`` (one per speculating sequence: its own
estimates and its rest). Knows nothing of blocks, models or token ids: the speculator
(``speculation.Speculator``) asks it how many tokens of each offered draft a step verifies and
tells it how each draft fared.

A draft row costs compute whether or not the model agrees with it. On the CPU kernels one more
row costs about a quarter of a one-row step, so a row is worth adding only while its draft
token's chance of acceptance beats the tokens per unit of cost that the step already yields,
a bar that rises with the batch (``allot``). The chance is estimated per match length, the
strongest signal there is: a draft continuing an earlier 4-gram of the sequence is nearly
always right when the sequence copies, one continuing a lone matching token rarely is (measured
on the default model: 1-gram drafts 0-19 % accepted, 4-gram ones 91-100 %). Each sequence
starts from what every sequence taught the pacer for that length, then follows its own record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DraftPacer", "DraftRecord"]


@dataclass
class DraftRecord:
    """One sequence's drafting record."""

    # by match length: the estimated chance that a draft token is accepted
    estimates: dict[int, float] = field(default_factory=dict)
    rest: int = 0  # steps to go without drafting
    misses: int = 0  # drafts in a row wholly rejected


# an offered draft: whose (its record), the length of the match it continues, how many tokens
Offer = tuple[DraftRecord, int, int]


class DraftPacer:
    """Decides each step's draft lengths and learns from the verified drafts."""

    # A CPU step's cost in units of one more token row: BASE + rows. The unit is what the
    # first extra row of a sequence costs, the dearest one (ops/bench/row_cost.py, default
    # model, 2 threads, 400-token contexts: one row 5.5 ms, two 7.0, three 8.1, five 9.7; in a
    # 4-stream story, one extra row took a step from 9.0 to 10.3 ms). Each sequence's attention
    # adds to a step with its context, which this leaves out: the bar errs on drafting too
    # little, never too much.
    BASE = 2.5
    # The chance before anything is known, by match length n: 0.2 n up to 0.8 (measured on
    # the default model: 1-gram drafts 0-19 % accepted, 2-grams 0-50 %, 4-grams 91-100 %). A
    # fresh 4-gram match is worth a draft in a batch of four, a fresh 1-gram match nowhere.
    PRIOR_STEP, PRIOR_MAX = 0.2, 0.8
    RATE = 0.3  # weight of a verified token in its sequence's estimate
    SHARED_RATE = 0.05  # ... and in its match length's estimate, shared by every sequence
    # An offer not worth a row moves its match length's shared estimate this share of the way
    # back to the prior: a length given up on (estimate 0.1) is tried again after ~150 steps of
    # a lone stream, in case the traffic has changed; a sequence's own record of it still
    # keeps that sequence from trying.
    DRIFT = 0.002
    MAX_REST = 31  # steps a sequence rests, at most, after wholly rejected drafts

    def __init__(self, max_n: int) -> None:
        self.prior = [min(self.PRIOR_STEP * n, self.PRIOR_MAX) for n in range(max_n + 1)]
        self.shared = list(self.prior)  # by match length

    def chance(self, record: DraftRecord, n: int) -> float:
        """The estimated chance that a token of a draft continuing an ``n``-gram is accepted."""
        return record.estimates.get(n, self.shared[n])

    def due(self, record: DraftRecord) -> bool:
        """Whether the sequence may draft this step (it rests after wholly rejected drafts; at
        the end of a rest its estimates move halfway back to the shared ones)."""
        if record.rest == 0:
            return True
        record.rest -= 1
        if record.rest == 0:
            for n, mine in record.estimates.items():
                record.estimates[n] = (mine + self.shared[n]) / 2
        return False

    def hopeless(self, record: DraftRecord, *, rows: int, tokens: int) -> bool:
        """Whether no draft of the sequence can be worth a row in a step of ``rows`` rows and
        ``tokens`` tokens: ``allot`` would keep none (its bar only rises as rows are added), so
        the sequence need not look for one, which costs ~20 us a sequence and step. Every
        length's shared estimate then drifts as an unused offer's does."""
        bar = tokens / (self.BASE + rows)
        lengths = range(1, len(self.shared))
        if any(self.chance(record, n) > bar for n in lengths):
            return False
        for n in lengths:
            self._unused(n)
        return True

    def allot(self, offers: list[Offer], *, rows: int, tokens: int) -> list[int]:
        """How many tokens of each offered draft a step of ``rows`` rows and ``tokens`` tokens
        to choose (drafts aside) verifies.

        Draft token ``j`` of an offer whose tokens are accepted with estimated probability ``a``
        is accepted with probability ``a ** j``: that is what its row adds to the step's
        expected tokens, for one unit of cost. A step yielding ``T`` tokens for cost ``C``
        yields more per unit of time with the row only if ``a ** j > T / C``; rows are added
        best first while that holds, so a large batch keeps only drafts likely to be accepted,
        and a lone stream drafts on weaker evidence.
        """
        expected, cost = float(tokens), self.BASE + rows
        chances: list[tuple[float, int]] = []  # (a draft token's chance, its offer)
        for i, (record, n, length) in enumerate(offers):
            a = self.chance(record, n)
            chances.extend((a ** (j + 1), i) for j in range(length))
        keep = [0] * len(offers)
        for chance, i in sorted(chances, key=lambda c: -c[0]):
            if chance * cost <= expected:
                break
            keep[i] += 1
            expected, cost = expected + chance, cost + 1
        for (_, n, _), kept in zip(offers, keep, strict=True):
            if not kept:
                self._unused(n)
        return keep

    def _unused(self, n: int) -> None:
        """An offer continuing an ``n``-gram was not worth a row: that length's shared estimate
        moves ``DRIFT`` of the way back to the prior, so a length given up on is tried again."""
        self.shared[n] += self.DRIFT * (self.prior[n] - self.shared[n])

    def learn(self, record: DraftRecord, n: int, drafted: int, accepted: int) -> None:
        """Account a verified draft continuing an ``n``-gram: each verified token (the
        ``accepted`` ones, and the first rejected) moves the sequence's estimate and the shared
        one; a wholly rejected draft makes the sequence rest 1, 3, 7 .. ``MAX_REST`` steps, longer
        after each such draft in a row."""
        outcomes = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        mine = self.chance(record, n)
        for x in outcomes:
            mine += self.RATE * (x - mine)
            self.shared[n] += self.SHARED_RATE * (x - self.shared[n])
        record.estimates[n] = mine
        if accepted:
            record.misses = 0
            return
        record.misses += 1
        record.rest = min(2**record.misses - 1, self.MAX_REST)
