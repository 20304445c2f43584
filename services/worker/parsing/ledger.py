"""Token accounting for one sequence: which generated ids have ridden on an event yet.

The stream invariant is that every fed token id rides on exactly one event, in order. The
ledger queues each token with the offset its text ends at in the decoded output (over all
channels: answer, reasoning, tool calls); an event that releases text up to some offset takes
the queued ids that end there or earlier. Marker tokens have no text, so they are taken by the
event they open or close. Ids fed after the sequence has stopped are held for ``Finish``.
"""

from __future__ import annotations

from shared.events import TokenLogprob

__all__ = ["TokenLedger"]


class TokenLedger:
    """Queued token ids with their text end offsets, and the ids held for ``Finish``."""

    def __init__(self) -> None:
        self.pos = 0  # characters decoded so far, over all channels
        self.taken_upto = 0  # text end offset of the last token put on an event
        self._queue: list[tuple[int, TokenLogprob | None, int]] = []  # (id, logprob, text end)
        self._held: list[int] = []

    def add(self, token_id: int, logprob: TokenLogprob | None, piece: str = "") -> str:
        """Queue a token whose decoded text is ``piece``; return the piece."""
        self.pos += len(piece)
        self._queue.append((token_id, logprob, self.pos))
        return piece

    def advance(self, piece: str) -> str:
        """Count text whose tokens are already queued (a detokenizer flush); return it."""
        self.pos += len(piece)
        return piece

    def hold(self, token_id: int) -> None:
        """Keep an id that shows nothing (fed past the end) for ``Finish``."""
        self._held.append(token_id)

    def take(self, upto: int) -> tuple[list[int], list[TokenLogprob]]:
        """Pop the queued tokens whose text ends at or before offset ``upto``."""
        n = 0
        while n < len(self._queue) and self._queue[n][2] <= upto:
            n += 1
        taken, self._queue = self._queue[:n], self._queue[n:]
        if taken:
            self.taken_upto = max(self.taken_upto, taken[-1][2])
        return [i for i, _, _ in taken], [lp for _, lp, _ in taken if lp is not None]

    def boundary(self, upto: int) -> int | None:
        """The largest text end offset of a queued token that is at or before ``upto``."""
        best: int | None = None
        for _, _, end in self._queue:
            if end > upto:
                break
            best = end
        return best

    def drain(self) -> list[int]:
        """Every id not yet on an event (queued, then held), for ``Finish``; forgets them."""
        ids = [i for i, _, _ in self._queue] + self._held
        self.forget()
        return ids

    def forget(self) -> None:
        """Treat every queued and held id as published (a resumed sequence)."""
        self._queue, self._held = [], []
