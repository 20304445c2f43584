"""Prompt-lookup drafts: what a sequence's own tokens suggest it will write next.

Owns ``NgramIndex``, one per speculating sequence. Agents copy: they rewrite a file with one
change, quote a tool result, repeat a signature. When the sequence's last ``n`` tokens (``n``
from ``max_n`` down to ``min_n``, longest first) occurred earlier in its prompt or output, the
tokens that followed the latest such occurrence are the draft; the model then verifies them in
one forward (``speculation.Speculator``). The latest occurrence rather than the first: in an
edit, the copy being written is the freshest context.

The index keeps, for every token and every pair of adjacent tokens, the positions where they
end, appended to as the tokens grow. A draft then looks up the positions of the last two tokens'
pair, latest first, and extends each match backwards while it lasts (a pair rarely recurs more
than a few times in agent contexts); with no such pair, the last token's latest position. That
costs 2-3 microseconds a draft on a 2-core Zen 5 EPYC at 1,000-15,000 tokens, where a
vectorized search over a numpy copy of the tokens (the second version) took 7-13: numpy's
per-call overhead, a dozen calls a draft, and on a decode step's cold cache about 20 us in
place, 1.5 % of a four-stream step (``ops/bench/drafting.py``). The price is memory, ~90 bytes
a token against 4 (0.4 % of what the default model's KV cache holds for the same tokens), and
indexing a long prompt at the first draft, ~0.3 us a token (5 ms for 15,000), against the
seconds its prefill takes on a CPU. A dict from every n-gram to its latest position (the first
version) held up to ``max_n`` entries a token, ~0.27 KB, and took 9-19 ms to index an 8k-token
prompt. Knows nothing about models, blocks or requests.
"""

from __future__ import annotations

from array import array

__all__ = ["NgramIndex"]


class NgramIndex:
    """The tokens of one growing list, searched for earlier occurrences of their suffix."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= {min_n} <= {max_n}")
        self.max_n, self.min_n = max_n, min_n
        # where each token, and each pair of adjacent tokens, ends: positions before _known
        self._singles: dict[int, array[int]] = {}
        self._pairs: dict[tuple[int, int], array[int]] = {}
        self._known = 0
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
            n, last = 2, ends[-1]
            for e in reversed(ends) if cap > 2 else ():
                m = 2
                while m < cap and e >= m and tokens[e - m] == tokens[end - 1 - m]:
                    m += 1
                if m > n:  # strictly longer: among equals, the latest (the first seen) stays
                    n, last = m, e
                    if m == cap:
                        break
        elif ends := self._singles.get(tokens[end - 1]):
            n, last = 1, ends[-1]
        if not n or n < self.min_n:
            return []
        self.matched, at = n, last + 1
        # The match says the text repeats with period end - at; past the end of what is
        # written, the draft goes on repeating (a loop, a run of one token).
        period = end - at
        return [tokens[at + i % period] for i in range(k)]
