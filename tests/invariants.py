"""The stream invariants of shared/events.py as one reusable checker.

Every test that produces an event stream passes it through ``check_stream``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from shared.events import (
    AnyEvent,
    Error,
    Finish,
    Start,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    is_terminal,
)

__all__ = ["check_stream", "generated_token_ids"]


def check_stream(events: Sequence[AnyEvent], *, complete: bool = True) -> None:
    """Assert the contract's invariants; ``complete=False`` accepts a stream still in flight."""
    terminals = [i for i, e in enumerate(events) if is_terminal(e)]
    if complete:
        assert len(terminals) == 1, f"expected exactly one terminal event, got {len(terminals)}"
        assert terminals[0] == len(events) - 1, "terminal event is not last"
    else:
        assert len(terminals) <= 1 and (not terminals or terminals[0] == len(events) - 1)
    if events and not isinstance(events[0], Start):
        assert isinstance(events[0], Error) and len(events) == 1, "Start must come first"
    assert sum(isinstance(e, Start) for e in events) <= 1, "more than one Start"
    usages = [i for i, e in enumerate(events) if isinstance(e, Usage)]
    assert len(usages) <= 1, "more than one Usage"
    if usages and terminals:
        assert usages[0] == terminals[0] - 1, "Usage must come right before the terminal event"
    if complete and isinstance(events[-1], Finish):
        assert usages, "a finished stream reports Usage"
    _check_tool_calls(events)


def _check_tool_calls(events: Sequence[AnyEvent]) -> None:
    open_index: int | None = None
    next_index = 0
    fragments = ""
    ids: set[str] = set()
    for e in events:
        if isinstance(e, ToolCallStart):
            assert open_index is None, f"tool call {e.index} starts while {open_index} is open"
            assert e.index == next_index, f"tool call index {e.index}, expected {next_index}"
            assert e.call_id not in ids, f"duplicate call id {e.call_id}"
            ids.add(e.call_id)
            open_index, fragments = e.index, ""
        elif isinstance(e, ToolCallArgsDelta):
            assert e.index == open_index, f"args for call {e.index} while {open_index} is open"
            assert e.fragment.strip(), "whitespace-only argument fragment"
            fragments += e.fragment
        elif isinstance(e, ToolCallEnd):
            assert e.index == open_index, f"end of call {e.index} while {open_index} is open"
            assert fragments == e.arguments, "fragments do not concatenate to the arguments"
            assert isinstance(json.loads(e.arguments), dict), "arguments are not a JSON object"
            open_index, next_index = None, next_index + 1
        else:
            assert open_index is None or is_terminal(e) or isinstance(e, Usage), (
                f"{type(e).__name__} inside tool call {open_index}"
            )


def generated_token_ids(events: Sequence[AnyEvent]) -> list[int]:
    """The token ids carried by all events, in order: the generated tokens."""
    out: list[int] = []
    for e in events:
        out.extend(getattr(e, "token_ids", ()))
    return out
