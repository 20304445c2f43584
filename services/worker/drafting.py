"""Prompt-lookup drafts: what a sequence's own tokens suggest it will write next.

Owns ``NgramIndex``, one per speculating sequence. Agents copy: they rewrite a file with one
change, quote a tool result, repeat a signature. When the sequence's last ``n`` tokens (``n``
from ``max_n`` down to ``min_n``, longest first) occurred earlier in its prompt or output, the
tokens that followed that earlier occurrence are the draft; the model then verifies them in one
forward (``speculation.Speculator``).

The index maps every n-gram to the position right after its latest occurrence, and it is
brought up to date from the tokens appended since the last draft (``max_n`` dict writes per
token), so a draft costs a few dict look-ups rather than a scan of the context. The latest
occurrence rather than the first: in an edit, the copy being written is the freshest context.
Knows nothing about models, blocks or requests.
"""

from __future__ import annotations

__all__ = ["NgramIndex"]


class NgramIndex:
    """The n-grams of one token list, by the position that followed their latest occurrence."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= {min_n} <= {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._next: dict[tuple[int, ...], int] = {}
        self._ends = 0  # n-grams ending before this position are indexed
        # the speculator's pacing for this sequence (``Speculator.verified``): the estimated
        # chance that a draft token is accepted, steps to go without drafting, and drafts in a
        # row that did not pay
        self.acceptance = 0.5
        self.rest = 0
        self.misses = 0

    def _catch_up(self, tokens: list[int]) -> None:
        # an n-gram ending at e is indexed once e + 1 exists, so a look-up of the sequence's
        # own suffix only ever finds an earlier occurrence
        for e in range(self._ends, len(tokens) - 1):
            for n in range(1, min(self.max_n, e + 1) + 1):
                self._next[tuple(tokens[e - n + 1 : e + 1])] = e + 1
        self._ends = max(self._ends, len(tokens) - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens``; ``tokens`` only ever grows between calls."""
        self._catch_up(tokens)
        if k < 1:
            return []
        end = len(tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = self._next.get(tuple(tokens[end - n :]))
            if at is None:
                continue
            # The match says the text repeats with period end - at; past the end of what is
            # written, the draft goes on repeating (a loop, a run of one token).
            period = end - at
            return [tokens[at + i % period] for i in range(k)]
        return []
