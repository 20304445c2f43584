"""Stop sequences on the answer text, with hold-back.

Text that could still be the start of a stop string is held, so a partial match is never emitted
and then retracted. When a stop string completes, the text before it is released and the match
(with everything after it) is dropped; the decoder puts the tokens that produced it on ``Finish``.
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    """Scans a growing text for the first occurrence of any stop string.

    Args:
        stops: The job's stop strings (empty strings are ignored).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.released = 0  # text[:released] may be emitted
        self.matched: str | None = None
        self.match_at: int | None = None

    def push(self, piece: str) -> str:
        """Append decoded text; return the newly releasable text (held text comes out later)."""
        if self.matched is not None:
            return ""
        self.text += piece
        if not self.stops:
            return self._release(len(self.text))
        # A match can only end inside the new piece, so search from just before the held text.
        window = max(0, self.released - self._longest)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = self.text.find(stop, window)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.match_at, self.matched = best
            return self._release(best[0])
        return self._release(len(self.text) - self._partial_suffix())

    def flush(self) -> str:
        """Release held text at the end of the answer or before a channel switch."""
        if self.matched is not None:
            return ""
        return self._release(len(self.text))

    def _partial_suffix(self) -> int:
        """Length of the longest suffix of the unreleased text that begins some stop string."""
        tail = self.text[self.released :]
        for size in range(min(len(tail), self._longest - 1), 0, -1):
            suffix = tail[-size:]
            if any(stop.startswith(suffix) for stop in self.stops):
                return size
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out = self.text[self.released : upto]
        self.released = upto
        return out
