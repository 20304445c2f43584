"""Prompt-lookup drafts: what a sequence's own tokens suggest it will write next.

Owns ``NgramIndex``, one per speculating sequence. Agents copy: they rewrite a file with one
change, quote a tool result, repeat a signature. When the sequence's last ``n`` tokens (``n``
from ``max_n`` down to ``min_n``, longest first) occurred earlier in its prompt or output, the
tokens that followed the latest such occurrence are the draft; the model then verifies them in
one forward (``speculation.Speculator``). The latest occurrence rather than the first: in an
edit, the copy being written is the freshest context.

The index keeps, for every token and every pair of adjacent tokens, the positions where they
end, appended to as the tokens grow. A draft looks up the positions of the last two tokens'
pair, latest first, and extends each match backwards while it lasts; with no such pair, the
last token's latest position. A pair rarely recurs more than a few times in agent contexts; one
that recurs more than ``SCAN`` times (an indentation after a newline, in code) is searched in
numpy, one vectorized compare over its occurrences per length, as the whole context once was.
On a 2-core Zen 5 EPYC that costs 1.7 us a draft (p99 2.4-2.9) at 1,000-32,000 prompt tokens,
where the vectorized search over the whole context (the second version) took 10.6-16.4 (p99
18-36; ``ops/bench/drafting.py``), about 20 us in place after a forward has cooled the caches,
1.5 % of a four-stream step. The price is memory, ~90 bytes a token against 4 (0.4 % of what
the default model's KV cache holds for the same tokens), and indexing a long prompt at its
first draft, ~0.3 us a token (2.7 ms for 8,000, 10 ms for 32,000), against the seconds its
prefill takes on a CPU. A dict from every n-gram to its latest position (the first version)
held up to ``max_n`` entries a token, ~0.27 KB, and took 9-19 ms to index an 8k-token prompt.
Knows nothing about models, blocks or requests.
"""

from __future__ import annotations

from array import array

import numpy as np

__all__ = ["NgramIndex"]


class NgramIndex:
    """The tokens of one growing list, searched for earlier occurrences of their suffix."""

    # A pair's occurrences are scanned one by one up to this many, in numpy past it (numpy's
    # dozen calls cost what scanning ~30 occurrences does)
    SCAN = 32

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= {min_n} <= {max_n}")
        self.max_n, self.min_n = max_n, min_n
        # where each token, and each pair of adjacent tokens, ends: positions before _known
        self._singles: dict[int, array[int]] = {}
        self._pairs: dict[tuple[int, int], array[int]] = {}
        self._known = 0
        # the tokens as a numpy array, caught up only when a pair recurs often (``_longest``)
        self._ids = np.empty(0, dtype=np.int32)
        self._copied = 0
        self.matched = 0  # the length of the match the last draft continues (0: none)

    def _index(self, tokens: list[int], upto: int) -> None:
        """Index the positions ``_known`` .. ``upto - 1`` of ``tokens``."""
        singles, pairs = self._singles, self._pairs
        prev = tokens[self._known - 1] if self._known else -1
        for p in range(self._known, upto):
            t = tokens[p]
            if (at := singles.get(t)) is None:
                singles[t] = array("i", (p,))
            else:
                at.append(p)
            if p:
                if (at := pairs.get((prev, t))) is None:
                    pairs[prev, t] = array("i", (p,))
                else:
                    at.append(p)
            prev = t
        self._known = max(self._known, upto)

    def _longest(self, tokens: list[int], ends: array[int], cap: int) -> tuple[int, int]:
        """The longest match (at most ``cap``) among the occurrences ``ends`` of the last two
        tokens, and where its latest occurrence ends."""
        end = len(tokens)
        if len(ends) > self.SCAN:
            return self._longest_vectorized(tokens, ends, cap)
        n, last = 2, ends[-1]
        for e in reversed(ends) if cap > 2 else ():
            m = 2
            while m < cap and e >= m and tokens[e - m] == tokens[end - 1 - m]:
                m += 1
            if m > n:  # strictly longer: among equals, the latest (the first seen) stays
                n, last = m, e
                if m == cap:
                    break
        return n, last

    def _longest_vectorized(self, tokens: list[int], ends: array[int], cap: int) -> tuple[int, int]:
        """``_longest`` for a pair that recurs often, one compare over its occurrences per
        length: a pair seen 10,000 times whose matches stop at two took 540 us a draft scanned
        one by one, and 90 over the whole context in numpy."""
        end = len(tokens)
        if end > len(self._ids):  # doubling: appends cost amortized O(1) a token
            grown = np.empty(max(2 * len(self._ids), end, 64), dtype=np.int32)
            grown[: self._copied] = self._ids[: self._copied]
            self._ids = grown
        self._ids[self._copied : end] = tokens[self._copied :]
        self._copied = end
        ids, at = self._ids, np.frombuffer(ends, dtype=np.int32)
        n = 2
        while n < cap:
            longer = at[at >= n]
            longer = longer[ids[longer - n] == ids[end - 1 - n]]
            if not len(longer):
                break
            at, n = longer, n + 1
        return n, int(at[-1])

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens``; ``tokens`` only ever grows between calls."""
        end = len(tokens)
        self.matched = 0
        if end < 2:
            return []
        self._index(tokens, end - 1)  # earlier occurrences end before the last token
        if k < 1:
            return []
        cap = min(self.max_n, end - 1)
        n = last = 0  # the longest match found, and where its latest occurrence ends
        if cap >= 2 and (ends := self._pairs.get((tokens[end - 2], tokens[end - 1]))):
            n, last = self._longest(tokens, ends, cap)
        elif ends := self._singles.get(tokens[end - 1]):
            n, last = 1, ends[-1]
        if not n or n < self.min_n:
            return []
        self.matched, at = n, last + 1
        # The match says the text repeats with period end - at; past the end of what is
        # written, the draft goes on repeating (a loop, a run of one token).
        period = end - at
        return [tokens[at + i % period] for i in range(k)]
