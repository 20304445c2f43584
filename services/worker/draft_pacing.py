"""When a speculating sequence drafts, and how many tokens: the speculator's pacing.

Owns ``DraftPacer`` (one per speculator: the step cost model, and the acceptance learned per
match length across sequences) and ``DraftRecord`` (one per speculating sequence: its own
estimates and its rest). Knows nothing of blocks, models or token ids: the speculator
(``speculation.Speculator``) asks it how many tokens of each offered draft a step verifies and
tells it how each draft fared.

A draft row costs compute whether or not the model agrees with it. On the CPU kernels one more
row costs a quarter to a sixth of a one-row step, so a row is worth adding only while its draft
token's chance of acceptance beats the tokens per unit of cost that the step already yields,
a bar that rises with the batch (``allot``). What a row costs against the step it joins is
measured (``StepCost``): it differs by machine (without AMX's tiles a row is dearer once a
step has a few), by backend (torch's GEMMs, a GPU) and by how the step runs (a GPU step with
draft rows cannot replay a decode graph). The chance is estimated per match length, the
strongest signal there is: a draft continuing an earlier 4-gram of the sequence is nearly
always right when the sequence copies, one continuing a lone matching token rarely is (measured
on the default model: 1-gram drafts 0-19 % accepted, 4-gram ones 91-100 %). Each sequence
starts from what every sequence taught the pacer for that length, then follows its own record,
which learns from its verified drafts and from drafts it looked at but did not verify, checked
against the tokens it then chose (``settle``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

__all__ = ["DraftPacer", "DraftRecord", "StepCost"]


@dataclass
class DraftRecord:
    """One sequence's drafting record."""

    # by match length: the estimated chance that a draft token is accepted
    estimates: dict[int, float] = field(default_factory=dict)
    rest: int = 0  # steps to go without drafting
    misses: int = 0  # drafts in a row wholly rejected
    # a draft looked at but not verified, to be checked against the tokens the sequence then
    # chooses (``DraftPacer.settle``): (its match length, its tokens, where they would start)
    shadow: tuple[int, list[int], int] | None = None
    probe: int = 0  # steps until a sequence that does not draft looks for a draft to check


# an offered draft: whose (its record), the length of the match it continues, how many tokens
Offer = tuple[DraftRecord, int, int]


class StepCost:
    """A step's cost in units of one draft row, as measured on this worker.

    Learns from whole decode steps (the forward and the token choice after it), by the step's
    rows: the time of a step without drafts, and the time a draft row adds to it, from steps
    with drafts set against the plain ones. Both depend on the rows: on a Zen 4 EPYC (AVX-512,
    no AMX) a draft row added 0.7 ms to one row's 4.9 ms step, which reading the weights bounds,
    but 1.2 ms to four rows' 6.4 ms, where the GEMMs and attention compute. Until both are
    known for a step's rows, the prior stands: ``BASE + rows``.

    The prior is the CPU kernels' on an AMX Xeon (ops/bench/row_cost.py, default model, 2
    threads, 400-token contexts: one row 5.5 ms, two 7.0, three 8.1, five 9.7; in a 4-stream
    story one more row took a step from 9.0 to 10.3 ms), in units of the dearest row. On the
    EPYC, four rows' step is 5.3 units, not the prior's 6.5, and the 73 %-accepted drafts of a
    four-stream story, which the prior let through, made it 5 % slower (ops/bench/speculative.py).
    """

    BASE = 2.5
    # Estimates are medians of each kind's latest steps: a step's time has a long right tail
    # (another process takes a core), and an average it drags up would overstate a plain step
    # against its draft rows, the side on which a wrong estimate costs speed.
    KEEP = 15
    # A row's cost is only measured while drafts are verified, so one measured in a slow spell
    # could keep drafts off for good: after this many plain steps of a row count without a
    # drafted one, its row cost is forgotten and the prior decides again. Each time it is
    # forgotten the wait doubles, up to MAX_STALE: a GPU whose drafted steps lose their decode
    # graph (an eager step costs several replayed ones) pays for one in 100 steps, then one in
    # 200 .. 6,400, not one in 100 for good.
    STALE, MAX_STALE = 100, 6400
    MAX_UNITS = 256.0  # rows nearly free (a GPU's eager step, memory-bound): a bound all the same

    def __init__(self) -> None:
        self.plain: dict[int, deque[float]] = {}  # by rows: seconds of steps without drafts
        self.row: dict[int, deque[float]] = {}  # by rows: seconds a draft row added to them
        self.since: dict[int, int] = {}  # by rows: plain steps since the last drafted one
        self.stale: dict[int, int] = {}  # by rows: plain steps after which a row cost is forgotten

    def observe(self, seconds: float, rows: int, drafted: int) -> None:
        """Learn from a decode step of ``rows`` rows and ``drafted`` draft rows."""
        if not drafted:
            self.plain.setdefault(rows, deque(maxlen=self.KEEP)).append(seconds)
            self.since[rows] = self.since.get(rows, 0) + 1
            stale = self.stale.get(rows, self.STALE)
            if self.since[rows] > stale and self.row.pop(rows, None) is not None:
                self.stale[rows] = min(2 * stale, self.MAX_STALE)
        elif rows in self.plain:
            added = max(seconds - median(self.plain[rows]), 0.0) / drafted
            self.row.setdefault(rows, deque(maxlen=self.KEEP)).append(added)
            self.since[rows] = 0

    def units(self, rows: int) -> float:
        """A step of ``rows`` rows (drafts aside), in units of a draft row.

        A row count whose draft rows were never measured but whose plain steps were takes the
        row cost measured at the nearest row count (the larger of two as near: a row costs more
        beside more rows). The batch shrinks as its streams end, and each new count would
        otherwise fall back to the prior, which on an AVX2 EPYC (Zen 3) put a three-row step
        at 5.5 units where it measured about 8: a copying stream's drafts were refused."""
        measured = rows if rows in self.row else None
        if measured is None and rows in self.plain and self.row:
            measured = min(self.row, key=lambda r: (abs(r - rows), -r))
        if measured is None:
            return self.BASE + rows
        plain, row = median(self.plain[rows]), median(self.row[measured])
        return min(plain / max(row, 1e-9), self.MAX_UNITS)


class DraftPacer:
    """Decides each step's draft lengths and learns from the verified drafts."""

    # A draft row must beat the step's yield by this much: a draft also spreads the finish
    # times of a batch's sequences (one that drafts ends first, and the rest run in a smaller,
    # less efficient batch), and a near-even bet is not worth the measurement's noise.
    MARGIN = 0.15
    # ... and, beside other streams, be accepted at least this often however cheap rows are.
    # In a batch that nothing waits to join, a token accepted for a stream that does not end
    # the run saves no step: that stream ends sooner and the run goes on in a smaller batch,
    # which saves about one row per step, what the draft row cost. Only copying pays there. On
    # torch's fp32 model (a row a thirtieth of a step) a four-stream story drafting at 30 %
    # ran 0.87-0.91x. On an AVX2 EPYC (Zen 3), with drafts checked even where not verified
    # (``settle``), a four-stream story drafting at 73 % ran 0.91-0.92x with a bar of one
    # half and 0.97x with this one, while the code edit, copying at 85-100 %, kept its 1.2x
    # (the speculative bench then still measured the story at 0.90-0.93x: its drafts that
    # clear this bar, 83 % accepted, lose too). A lone stream has no batch to spread.
    MIN_CHANCE = 0.8
    # The chance before anything is known, by match length n: 0.2 n up to 0.8 (measured on
    # the default model: 1-gram drafts 0-19 % accepted, 2-grams 0-50 %, 4-grams 91-100 %). A
    # fresh 4-gram match is worth a draft alone, not beside other streams (``MIN_CHANCE``); a
    # fresh 1-gram match nowhere.
    PRIOR_STEP, PRIOR_MAX = 0.2, 0.8
    RATE = 0.3  # weight of a verified token in its sequence's estimate
    SHARED_RATE = 0.05  # ... and in its match length's estimate, shared by every sequence
    # An offer not worth a row moves its match length's shared estimate this share of the way
    # back to the prior: a length given up on (estimate 0.1) is tried again after ~150 steps of
    # a lone stream, in case the traffic has changed; a sequence's own record of it still
    # keeps that sequence from trying.
    DRIFT = 0.002
    MAX_REST = 31  # steps a sequence rests, at most, after wholly rejected drafts
    # A sequence that does not draft (resting, or no draft worth a row) still looks for one
    # every this many steps, to check it against the tokens it then chooses: what keeps its
    # estimates true when it starts to copy (``settle``). Looking costs ~20 us, which is what
    # ``hopeless`` saves a large batch: there a sequence looks every rows / 4 steps, so a step
    # spends at most ~80 us on it however many rows it has.
    PROBE = 4

    def __init__(self, max_n: int) -> None:
        self.prior = [min(self.PRIOR_STEP * n, self.PRIOR_MAX) for n in range(max_n + 1)]
        self.shared = list(self.prior)  # by match length
        self.cost = StepCost()

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
        bar = max((1 + self.MARGIN) * tokens / self.cost.units(rows), self._floor(tokens))
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
        yields more per unit of time with the row only if ``a ** j > T / C``, here with a
        ``MARGIN``; rows are added best first while that holds, so a large batch keeps only drafts
        likely to be accepted, and a lone stream drafts on weaker evidence.
        """
        expected, cost, floor = float(tokens), self.cost.units(rows), self._floor(tokens)
        chances: list[tuple[float, int]] = []  # (a draft token's chance, its offer)
        for i, (record, n, length) in enumerate(offers):
            a = self.chance(record, n)
            chances.extend((a ** (j + 1), i) for j in range(length))
        keep = [0] * len(offers)
        for chance, i in sorted(chances, key=lambda c: -c[0]):
            if chance * cost <= (1 + self.MARGIN) * expected or chance <= floor:
                break
            keep[i] += 1
            expected, cost = expected + chance, cost + 1
        for (_, n, _), kept in zip(offers, keep, strict=True):
            if not kept:
                self._unused(n)
        return keep

    def _floor(self, tokens: int) -> float:
        """The least chance a draft row needs in a step choosing ``tokens`` tokens."""
        return self.MIN_CHANCE if tokens > 1 else 0.0

    def _unused(self, n: int) -> None:
        """An offer continuing an ``n``-gram was not worth a row: that length's shared estimate
        moves ``DRIFT`` of the way back to the prior, so a length given up on is tried again."""
        self.shared[n] += self.DRIFT * (self.prior[n] - self.shared[n])

    def probing(self, record: DraftRecord, *, rows: int) -> bool:
        """Whether a sequence that does not draft this step, of ``rows`` rows, looks for a
        draft to check later (``shadow``): every ``PROBE`` steps (every ``rows / PROBE`` in a
        larger step), while no looked-at draft is outstanding."""
        if record.shadow is not None:
            return False
        record.probe -= 1
        if record.probe > 0:
            return False
        record.probe = max(self.PROBE, rows // self.PROBE)
        return True

    def shadow(self, record: DraftRecord, n: int, draft: list[int], at: int) -> None:
        """Keep a draft continuing an ``n``-gram that the step does not verify, to check it
        against the sequence's tokens from position ``at`` on (``settle``)."""
        if record.shadow is None:
            record.shadow = (n, draft, at)

    def settle(self, record: DraftRecord, tokens: list[int]) -> None:
        """Learn from a kept, unverified draft once ``tokens`` (the sequence's) show how far it
        would have been accepted: the same evidence a verification gives, for no row.

        Without it a sequence learned only from drafts it paid for: a few rejected ones at the
        start of a code edit (the model's preamble) put its estimates below a four-stream step's
        bar, and it never drafted again, though it then copied the file (measured on the default
        model at four streams: 4 to 644 draft tokens verified in runs of the same jobs, 1.03x
        the plain rate against 1.18x for a fixed one-token draft). For a draw, a draft token is
        matched with the probability it would be accepted with (its probability under the
        model), so the estimate stays unbiased."""
        if record.shadow is None:
            return
        n, draft, at = record.shadow
        chosen = tokens[at : at + len(draft)]
        accepted = 0
        while accepted < len(chosen) and chosen[accepted] == draft[accepted]:
            accepted += 1
        if accepted == len(chosen) < len(draft):
            return  # every token so far matches: the rest are yet to be chosen
        record.shadow = None
        self._estimate(record, n, len(draft), accepted)

    def learn(self, record: DraftRecord, n: int, drafted: int, accepted: int) -> None:
        """Account a verified draft continuing an ``n``-gram: each verified token (the
        ``accepted`` ones, and the first rejected) moves the sequence's estimate and the shared
        one; a wholly rejected draft makes the sequence rest 1, 3, 7 .. ``MAX_REST`` steps, longer
        after each such draft in a row."""
        self._estimate(record, n, drafted, accepted)
        if accepted:
            record.misses = 0
            return
        record.misses += 1
        record.rest = min(2**record.misses - 1, self.MAX_REST)

    def _estimate(self, record: DraftRecord, n: int, drafted: int, accepted: int) -> None:
        """Move the sequence's and the shared estimate for ``n``-grams by each verified token of
        a draft (the ``accepted`` ones, and the first rejected)."""
        outcomes = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        mine = self.chance(record, n)
        for x in outcomes:
            mine += self.RATE * (x - mine)
            self.shared[n] += self.SHARED_RATE * (x - self.shared[n])
        record.estimates[n] = mine
