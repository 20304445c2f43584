"""The fold that every non-streaming response is rendered from."""

from __future__ import annotations

import pytest

from shared.accumulate import ReasoningBlock, TextBlock, ToolCallBlock, fold
from tests.factories import SCENARIOS
from tests.invariants import check_stream, generated_token_ids


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_satisfy_the_invariants(name: str) -> None:
    check_stream(SCENARIOS[name]())


def test_fold_keeps_block_order_and_merges_adjacent_deltas() -> None:
    done = fold(SCENARIOS["reasoning_tool_call"]())
    assert [type(b) for b in done.blocks] == [ReasoningBlock, ToolCallBlock]
    assert done.reasoning == "Need the weather."
    assert done.tool_calls[0].arguments == '{"city": "Paris"}'
    assert done.finish is not None and done.finish.reason == "tool_use"
    assert done.usage is not None and done.usage.reasoning_tokens == 2


def test_fold_of_parallel_calls_and_text() -> None:
    done = fold(SCENARIOS["parallel_tool_calls"]())
    assert isinstance(done.blocks[0], TextBlock)
    assert [c.call_id for c in done.tool_calls] == ["call_a1", "call_b2"]
    assert [c.arguments for c in done.tool_calls] == ['{"city": "Paris"}', '{"city": "Oslo"}']


def test_fold_of_an_error_keeps_partial_text() -> None:
    done = fold(SCENARIOS["error"]())
    assert done.text == "Partial" and done.error is not None and done.finish is None


def test_token_ids_are_carried_end_to_end() -> None:
    assert generated_token_ids(SCENARIOS["stop_sequence"]()) == [70, 71, 72, 73, 74]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ev: ev[:-1], "exactly one terminal"),
        (lambda ev: ev + ev[-1:], "exactly one terminal"),
        (lambda ev: ev[1:], "Start must come first"),
        (lambda ev: [ev[0], *ev[2:3], ev[1], *ev[3:]], "tool call 0"),
        (lambda ev: [*ev[:-2], ev[-1]], "Usage"),
    ],
)
def test_checker_rejects_broken_streams(mutate, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_stream(mutate(SCENARIOS["parallel_tool_calls"]()))
