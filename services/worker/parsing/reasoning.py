"""Token-level reasoning routing state: which channel the next token belongs to.

The router never looks at text: the marker ids flip the state, so a marker can never be split
across decode steps or chunks (vLLM #55195). The initial state comes from the prompt
(``starts_in_reasoning``), and a budget makes ``forced_close`` name the close marker.
"""

from __future__ import annotations

from shared.model_card import ReasoningMarkers
from shared.prompt import starts_in_reasoning

__all__ = ["ReasoningRouter", "starts_in_reasoning"]


class ReasoningRouter:
    """Tracks whether generation is inside a reasoning block.

    Args:
        markers: The model's reasoning markers, or None (then nothing is ever reasoning).
        inside: Whether the prompt left a block open.
        budget: Reasoning tokens allowed before the close marker is forced (None: unlimited).
    """

    def __init__(
        self, markers: ReasoningMarkers | None, *, inside: bool = False, budget: int | None = None
    ) -> None:
        self.markers = markers
        self.inside = inside and markers is not None
        self.budget = budget
        self.spent = 0  # body tokens generated inside reasoning (markers excluded)

    def is_open(self, token_id: int) -> bool:
        """True when ``token_id`` opens a block now (we are outside one)."""
        return self.markers is not None and not self.inside and token_id == self.markers.open_id

    def is_close(self, token_id: int) -> bool:
        """True when ``token_id`` closes the block we are in."""
        return self.markers is not None and self.inside and token_id == self.markers.close_id

    def count(self) -> None:
        """Record one body token spent inside reasoning."""
        self.spent += 1

    def forced_close(self) -> int | None:
        """The close marker id when the budget is spent inside a block, else None."""
        if self.markers is None or not self.inside or self.budget is None:
            return None
        return self.markers.close_id if self.spent >= self.budget else None
