"""When a speculating sequence drafts, and how many tokens: the speculator's pacing.

Owns ``DraftPacer`` (one per speculator: the step cost model, and the acceptance learned per
match length across sequences) and ``DraftRecord`` (one per speculating sequence: its own
estimates). Knows nothing of blocks, models or token ids: the speculator
(``speculation.Speculator``) asks it how many tokens of each offered draft a step verifies and
tells it how each draft fared.

A draft row costs compute whether or not the model agrees with it. On the CPU kernels one more
row costs a quarter to a sixth of a one-row step, so rows are worth adding only while their
draft tokens' chances of acceptance raise the tokens per second the step yields, a bar that
rises with the batch (``allot``). What draft rows add to the step they join is measured
(``step_cost.StepCost``), per count of rows: it differs by machine (without AMX's tiles a row
is dearer once a step has a few; on AVX2 the first row past a multiple of four pays a weight
pass of its own), by backend (torch's GEMMs, a GPU) and by how the step runs (a GPU step with
draft rows cannot replay a decode graph). The chance is estimated per match length, the
strongest signal there is: a draft continuing an earlier 4-gram of the sequence is nearly
always right when the sequence copies, one continuing a lone matching token rarely is (measured
on the default model: 1-gram drafts 0-19 % accepted, 4-gram ones 91-100 %). Each sequence
starts from what every sequence taught the pacer for that length, then follows its own record,
which learns from its verified drafts and from drafts it looked at but did not verify, checked
against the tokens it then chose (``settle``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.step_cost import StepCost

__all__ = ["DraftPacer", "DraftRecord"]


@dataclass
class DraftRecord:
    """One sequence's drafting record."""

    # by match length: the estimated chance that a draft token is accepted
    estimates: dict[int, float] = field(default_factory=dict)
    # a draft looked at but not verified, to be checked against the tokens the sequence then
    # chooses (``DraftPacer.settle``): (its match length, its tokens, where they would start)
    shadow: tuple[int, list[int], int] | None = None
    probe: int = 0  # steps until a sequence that does not draft looks for a draft to check


# an offered draft: whose (its record), the length of the match it continues, how many tokens
Offer = tuple[DraftRecord, int, int]


class DraftPacer:
    """Decides each step's draft lengths and learns from the verified drafts."""

    # A draft row must beat the step's yield by this much: a draft also spreads the finish
    # times of a batch's sequences (one that drafts ends first, and the rest run in a smaller,
    # less efficient batch), and a near-even bet is not worth the measurement's noise.
    MARGIN = 0.15
    # ... and, beside streams that offer no draft, be accepted at least this often however
    # cheap rows are. In a batch that nothing waits to join, a token accepted for a stream that
    # does not end the run saves no step: that stream ends sooner and the run goes on in a
    # smaller batch, which saves about one row per step, what the draft row cost. Only copying
    # pays there. Where every stream of the step offers one, the batch moves on together and
    # the cost alone decides: after the model departs from its source, copying streams' drafts
    # (estimates 0.65-0.8) wait for no bar (on a Zen 4 EPYC a four-stream code edit ran
    # 1.36-1.43x against 1.28-1.34x with the bar everywhere, as fast as verifying every offer,
    # in one process; the story was unchanged; on torch's fp32 model, a row a thirtieth of a
    # step, the code edit ran 2.69x against 2.00x and the story 1.07x against 0.97x). With no
    # bar at all, on an AVX2 EPYC (Zen 3) a four-stream story drafting at 73 % ran 0.91-0.92x
    # with a bar of one half and 0.97x with this one, and on torch's model one drafting at
    # 30 % ran 0.87-0.91x. A lone stream has no batch to spread.
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
    # A sequence that does not draft (no draft worth a row) still looks for one
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

    def hopeless(self, record: DraftRecord, *, rows: int, tokens: int) -> bool:
        """Whether no draft of the sequence can be worth a row in a step of ``rows`` rows and
        ``tokens`` tokens: ``allot`` would keep none of its rows, wherever they fell among the
        step's (its best chance, discounted by ``MARGIN``, does not beat the plain step's
        tokens per time at the cheapest a row comes; ``MIN_CHANCE`` is not asked, as it depends
        on the others' offers), so the sequence need not look for one, which costs ~20 us a
        sequence and step. Every length's shared estimate then drifts as an unused offer's
        does."""
        price = self.cost.price(rows)
        limit = (1 + self.MARGIN) * tokens * price.cheapest_row
        mine, shared = record.estimates, self.shared  # ``chance``, inlined: asked every step
        for n in range(1, len(shared)):
            if mine.get(n, shared[n]) * price.plain > limit:
                return False
        for n in range(1, len(self.shared)):
            self._unused(n)
        return True

    def allot(self, offers: list[Offer], *, rows: int, tokens: int) -> list[int]:
        """How many tokens of each offered draft a step of ``rows`` rows and ``tokens`` tokens
        to choose (drafts aside) verifies.

        Draft token ``j`` of an offer whose tokens are accepted with estimated probability ``a``
        is accepted with probability ``a ** j``: that is what its row adds to the step's
        expected tokens, here discounted by ``MARGIN``. Rows are taken best first, and the step
        verifies as many as make its expected tokens per time highest, if that beats the plain
        step's (``StepCost.price``: what so many draft rows add, as measured). So a large batch
        keeps only drafts likely to be accepted, a lone stream drafts on weaker evidence, and
        rows whose first is dear (a weight pass of its own) are verified when enough of them
        share it. Beside a stream that offers none, a row also needs ``MIN_CHANCE``. Every
        ``StepCost.REFRESH`` drafted steps the step is plain instead.
        """
        keep = [0] * len(offers)
        if self.cost.refresh(rows):
            return keep
        floor = self._floor(tokens, len(offers))
        chances: list[tuple[float, int]] = []  # (a draft token's chance, its offer)
        for i, (record, n, length) in enumerate(offers):
            a = self.chance(record, n)
            chances.extend((a ** (j + 1), i) for j in range(length))
        chances.sort(key=lambda c: -c[0])
        price = self.cost.price(rows)
        added = price.added_upto(len(chances))
        best, rows_kept, expected = tokens / price.plain, 0, float(tokens)
        for d, (chance, _) in enumerate(chances, start=1):
            if chance <= floor:
                break
            expected += chance / (1 + self.MARGIN)
            if expected / (price.plain + added[d]) > best:
                best, rows_kept = expected / (price.plain + added[d]), d
        for _, i in chances[:rows_kept]:
            keep[i] += 1
        for (_, n, _), kept in zip(offers, keep, strict=True):
            if not kept:
                self._unused(n)
        return keep

    def _floor(self, tokens: int, offers: int) -> float:
        """The least chance a draft row needs in a step choosing ``tokens`` tokens, ``offers``
        of whose sequences offer a draft: ``MIN_CHANCE`` only beside streams without one."""
        return self.MIN_CHANCE if offers < tokens else 0.0

    def _unused(self, n: int) -> None:
        """An offer continuing an ``n``-gram was not worth a row: that length's shared estimate
        moves ``DRIFT`` of the way back to the prior, so a length given up on is tried again."""
        self.shared[n] += self.DRIFT * (self.prior[n] - self.shared[n])

    def probing(self, record: DraftRecord, *, rows: int) -> bool:
        """Whether a sequence that does not draft this step, of ``rows`` rows, looks for a
        draft to check later (``shadow``): every ``PROBE`` steps (every ``rows / PROBE`` in a
        larger step), and on the step after a rejected draft (``learn``), while no looked-at
        draft is outstanding."""
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
        model), so the estimate stays unbiased. Matched tokens are learned as they are chosen,
        not once the whole draft is: a sequence that copies again after a rejection earns back a
        row a step sooner."""
        if record.shadow is None:
            return
        n, draft, at = record.shadow
        chosen = tokens[at : at + len(draft)]
        accepted = 0
        while accepted < len(chosen) and chosen[accepted] == draft[accepted]:
            accepted += 1
        if accepted == len(chosen) < len(draft):
            # every token so far matches: those are learned now, the rest once chosen
            if accepted:
                self.learn(record, n, accepted, accepted)
                record.shadow = (n, draft[accepted:], at + accepted)
            return
        record.shadow = None
        self.learn(record, n, len(draft), accepted)

    def learn(self, record: DraftRecord, n: int, drafted: int, accepted: int) -> None:
        """Move the sequence's and the shared estimate for ``n``-grams by each verified token of
        a draft (the ``accepted`` ones, and the first rejected).

        A wholly rejected draft only lowers the estimate, and the step's cost then decides
        whether the next is worth a row. Sequences once rested 1, 3, 7 .. 31 steps after such a
        draft; that cost a copying sequence the steps right after the model departs from its
        source (a rename), where copying resumes: on a Zen 3 EPYC a lone code edit spent a
        third of its steps resting, and ran 1.74x the plain rate with rests against 1.89x
        without (1.98x with every draft verified at four tokens), in one process. A story after
        a code edit drafts more without them (70 draft tokens a run against 35, 22 % accepted)
        and ran 0.98x against 1.00x, within the spread of its runs. A rejection also makes the
        sequence look for a draft on the next step even if none would be verified (``probing``):
        one that then matches is learned token by token (``settle``), which lifts a copying
        sequence's estimate back over a batch's bar within a step or two. A looked-at draft
        still outstanding is kept: tokens it shares with verified ones count twice, which lifts
        the estimate faster as copying resumes (dropping it ran a lone code edit 1.7 % slower
        on a Zen 4 EPYC, in one process)."""
        outcomes = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        mine = self.chance(record, n)
        for x in outcomes:
            mine += self.RATE * (x - mine)
            self.shared[n] += self.SHARED_RATE * (x - self.shared[n])
        record.estimates[n] = mine
        if accepted < drafted:
            record.probe = 0
