"""Prompt-lookup drafts: what a sequence's own tokens suggest it will write next.

Owns ``NgramIndex``, one per speculating sequence. Agents copy: they rewrite a file with one
change, quote a tool result, repeat a signature. When the sequence's last ``n`` tokens (``n``
from ``max_n`` down to ``min_n``, longest first) occurred earlier in its prompt or output, the
tokens that followed the latest such occurrence are the draft; the model then verifies them in
one forward (``speculation.Speculator``). The latest occurrence rather than the first: in an
edit, the copy being written is the freshest context.

The search runs over a copy of the tokens in a numpy array, appended to as they grow: the
positions of the last token's earlier occurrences, then those of them preceded by the token
before it, and so on up to ``max_n``, each a vectorized compare. That costs 4 bytes a token and a
10-20 microseconds a draft at agent context lengths, where a dict from every n-gram to its latest
position (the first version) held up to ``max_n`` entries a token, ~0.27 KB, and took 9-19 ms to
index an 8k-token prompt at the first draft (docs/benchmarks.md, *Speculative decoding*).
Knows nothing about models, blocks or requests.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NgramIndex"]


class NgramIndex:
    """The tokens of one growing list, searched for earlier occurrences of their suffix."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= {min_n} <= {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._ids = np.empty(0, dtype=np.int32)  # tokens[:_known], then spare room
        self._known = 0
        self.matched = 0  # the length of the match the last draft continues (0: none)

    def _catch_up(self, tokens: list[int]) -> np.ndarray:
        end = len(tokens)
        if end > len(self._ids):  # doubling: appends cost amortized O(1) a token
            grown = np.empty(max(2 * len(self._ids), end, 64), dtype=np.int32)
            grown[: self._known] = self._ids[: self._known]
            self._ids = grown
        if end > self._known:
            self._ids[self._known : end] = tokens[self._known :]
            self._known = end
        return self._ids[:end]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens``; ``tokens`` only ever grows between calls."""
        ids = self._catch_up(tokens)
        end = len(ids)
        self.matched = 0
        if k < 1 or end < 2:
            return []
        # e: where an earlier occurrence of the suffix ends (before the last token's position)
        ends = np.flatnonzero(ids[: end - 1] == ids[end - 1])
        n = 1
        while n < min(self.max_n, end - 1) and len(ends):
            longer = ends[ends >= n]
            longer = longer[ids[longer - n] == ids[end - 1 - n]]
            if not len(longer):
                break
            ends, n = longer, n + 1
        if not len(ends) or n < self.min_n:
            return []
        self.matched, at = n, int(ends[-1]) + 1
        # The match says the text repeats with period end - at; past the end of what is
        # written, the draft goes on repeating (a loop, a run of one token).
        period = end - at
        return [tokens[at + i % period] for i in range(k)]
