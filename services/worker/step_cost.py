"""What a decode step costs on this worker, and what draft rows add to it: the speculator's
cost model (``draft_pacing.DraftPacer`` weighs draft rows with it).

Owns ``StepCost`` (one per pacer: the medians of measured steps, per count of rows and of draft
rows) and ``Price`` (a step's plain time and its draft rows' added time, as ``StepCost.price``
reads them). Knows nothing of drafts' chances, sequences or models: it is told each decode
step's time, rows and draft rows (``speculation.Speculator.observe``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from statistics import median

__all__ = ["Price", "StepCost"]


@dataclass(frozen=True)
class Price:
    """A step's time without drafts, and what draft rows add to it, in one unit: seconds where
    measured, else the prior's (a draft row)."""

    plain: float
    # (draft rows, the time they add), from (0, 0) up, as measured; past the last point each
    # row adds what the last two points' rows did (one point: its average)
    points: tuple[tuple[int, float], ...]

    def added(self, d: int) -> float:
        """What ``d`` draft rows add to the step."""
        return self.added_upto(d)[d]

    def added_upto(self, n: int) -> list[float]:
        """What 0, 1 .. ``n`` draft rows add to the step, in one pass over the points (a
        step of hundreds of streams weighs as many counts)."""
        out, segments = [0.0], pairwise(self.points)
        (d0, a0), (d1, a1) = next(segments)
        for d in range(1, n + 1):
            while d > d1 and (later := next(segments, None)) is not None:
                (d0, a0), (d1, a1) = later
            if d > d1:  # past the last point
                out.append(a1 + self.slope * (d - d1))
            else:
                out.append(a0 + (a1 - a0) * (d - d0) / (d1 - d0))
        return out

    @cached_property
    def slope(self) -> float:
        """What a row adds past the last measured point."""
        (d0, a0), (d1, a1) = self.points[-2:]
        return max((a1 - a0) / (d1 - d0), 0.0)

    @cached_property
    def cheapest_row(self) -> float:
        """The least any one draft row adds, wherever it falls."""
        steps = ((a1 - a0) / (d1 - d0) for (d0, a0), (d1, a1) in pairwise(self.points))
        return min(self.slope, *steps)


class StepCost:
    """A decode step's time as measured on this worker: without drafts, and what ``d`` draft
    rows add to it, by the step's rows.

    Learns from whole decode steps (the forward and the token choice after it). What draft rows
    add is neither linear nor the same everywhere, so it is kept per draft-row count, not as
    one cost per row: on an AVX2 EPYC (four streams after 900 tokens, 15.0 ms a step) the first
    draft row added 4.4 ms and the next three 2.4, 2.5 and 1.9 (a fifth row pays a weight pass
    of its own), while beside one row on an AMX Xeon the first is the cheapest. A per-row
    average priced every row as the dear first and kept a four-stream code edit from drafting
    at all in some runs (1.03x the plain rate against 1.16x with this model).
    Until a row count's steps are measured, the prior stands: ``BASE + rows`` units, a unit
    per draft row (the CPU kernels' on an AMX Xeon, ops/bench/row_cost.py, in units of the
    dearest row).
    """

    BASE = 2.5
    # Estimates are medians of each kind's latest steps: a step's time has a long right tail
    # (another process takes a core), and an average it drags up would overstate a plain step
    # against its draft rows, the side on which a wrong estimate costs speed.
    KEEP = 15
    # What draft rows add is only measured while drafts are verified, so one measured in a slow
    # spell could keep drafts off for good: after this many plain steps of a row count without
    # a drafted one, it is forgotten and the prior decides again. Each time it is forgotten the
    # wait doubles, up to MAX_STALE: a GPU whose drafted steps lose their decode graph (an
    # eager step costs several replayed ones) pays for one in 100 steps, then one in 200 ..
    # 6,400, not one in 100 for good.
    STALE, MAX_STALE = 100, 6400
    # Drafted steps are set against the plain steps before them, which a stream that drafts
    # every step never refreshes: their contexts fall behind (each cached token makes a step
    # dearer), and a drift of the machine is charged to the drafts. So after this many drafted
    # steps of a row count in a row, one step is plain (``DraftPacer.allot``): ~3 % of a
    # copying stream's steps.
    REFRESH = 32

    def __init__(self) -> None:
        self.plain: dict[int, deque[float]] = {}  # by rows: seconds of steps without drafts
        # by rows, by draft rows: the seconds those draft rows added to the rows' plain step
        self.added: dict[int, dict[int, deque[float]]] = {}
        self.since: dict[int, int] = {}  # by rows: plain steps since the last drafted one
        self.stale: dict[int, int] = {}  # by rows: plain steps after which ``added`` is forgotten
        self.drafted: dict[int, int] = {}  # by rows: drafted steps since the last plain one
        # Derived, kept until what they derive from changes: a step asks for its price once
        # per sequence (``hopeless``), and each step changes one of the medians (recomputing all
        # of them every step took ~30 us of a four-stream step under a profiler, on a Zen 5)
        self.priced: dict[int, Price] = {}  # by rows
        self.medians: dict[int, float] = {}  # by rows: the plain steps' median
        self.curves: dict[int, list[tuple[int, float]]] = {}  # by rows: ``_rising(added)``

    def observe(self, seconds: float, rows: int, drafted: int) -> None:
        """Learn from a decode step of ``rows`` rows and ``drafted`` draft rows."""
        if not drafted:
            self.plain.setdefault(rows, deque(maxlen=self.KEEP)).append(seconds)
            self.medians.pop(rows, None)
            self.priced.pop(rows, None)
            self.drafted[rows] = 0
            self.since[rows] = self.since.get(rows, 0) + 1
            stale = self.stale.get(rows, self.STALE)
            if self.since[rows] > stale and self.added.pop(rows, None) is not None:
                self.stale[rows] = min(2 * stale, self.MAX_STALE)
                self.curves.pop(rows, None)
                self.priced.clear()  # other counts may have borrowed what it added
        elif rows in self.plain:
            added = max(seconds - self._median(rows), 0.0)
            by_count = self.added.setdefault(rows, {})
            by_count.setdefault(drafted, deque(maxlen=self.KEEP)).append(added)
            self.curves.pop(rows, None)
            self.priced.clear()
            self.since[rows] = 0
            self.drafted[rows] = self.drafted.get(rows, 0) + 1

    def _median(self, rows: int) -> float:
        """The median of the latest plain steps of ``rows`` rows."""
        if rows not in self.medians:
            self.medians[rows] = median(self.plain[rows])
        return self.medians[rows]

    def refresh(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows should be plain, to measure one (``REFRESH``)."""
        return self.drafted.get(rows, 0) >= self.REFRESH

    def price(self, rows: int) -> Price:
        """A step of ``rows`` rows (drafts aside) and what draft rows add to it.

        A row count whose draft rows were never measured but whose plain steps were takes what
        they add at the nearest row count (the larger of two as near: a row costs more beside
        more rows), or the prior's share of its plain step. The batch shrinks as its streams
        end, and each new count would otherwise fall back to the prior, which on an AVX2 EPYC
        (Zen 3) put a three-row step at 5.5 units where it measured about 8: a copying stream's
        drafts were refused."""
        if rows not in self.priced:
            self.priced[rows] = self._price(rows)
        return self.priced[rows]

    def _price(self, rows: int) -> Price:
        if rows not in self.plain:
            return Price(self.BASE + rows, ((0, 0.0), (1, 1.0)))
        plain = self._median(rows)
        measured = rows if rows in self.added else None
        if measured is None and self.added:
            measured = min(self.added, key=lambda r: (abs(r - rows), -r))
        if measured is None:
            return Price(plain, ((0, 0.0), (1, plain / (self.BASE + rows))))
        if measured not in self.curves:
            self.curves[measured] = _rising(self.added[measured])
        return Price(plain, ((0, 0.0), *self.curves[measured]))


def _rising(added: dict[int, deque[float]]) -> list[tuple[int, float]]:
    """Each draft-row count's median added time, made to never fall as rows are added: where a
    count's median lies above a larger count's, both take their steps' weighted mean (pool
    adjacent violators). A count seldom verified keeps a median from few steps, one of them in
    a slow spell, say; unsmoothed, it would price its rows above more rows' and never be chosen,
    so never measured again (seen on an AVX2 EPYC: 22.6 ms for four draft rows beside four
    streams, 17.9 for six)."""
    pools: list[tuple[float, int, list[int]]] = []  # (weighted sum, steps, counts)
    for d, times in sorted(added.items()):
        total, steps, counts = median(times) * len(times), len(times), [d]
        while pools and pools[-1][0] / pools[-1][1] > total / steps:
            was = pools.pop()
            total, steps, counts = total + was[0], steps + was[1], was[2] + counts
        pools.append((total, steps, counts))
    return [(d, total / steps) for total, steps, counts in pools for d in counts]
