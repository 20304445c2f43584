"""How many reasoning tokens a job may spend before the close marker is forced.

An explicit ``budget_tokens`` wins. Otherwise an explicit effort maps to a budget: ``none`` is 0
(the block is closed at once where the template could not switch thinking off), ``minimal`` 256,
``low`` 1024, ``medium`` 4096, ``high`` unlimited. No control at all means unlimited: the model's
own habit, bounded by ``max_tokens``.
"""

from __future__ import annotations

from shared.jobs import ReasoningControl

__all__ = ["EFFORT_BUDGETS", "reasoning_budget"]

EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": None,
}


def reasoning_budget(control: ReasoningControl) -> int | None:
    """Return the reasoning token budget for a control, or None for unlimited."""
    if control.budget_tokens is not None:
        return max(0, control.budget_tokens)
    if control.effort is not None:
        return EFFORT_BUDGETS[control.effort]
    return None
