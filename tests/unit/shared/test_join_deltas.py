"""Joining a stream's runs of deltas (``shared.events.join_deltas``): the worker publishes
several decode steps' events as one batch, joined so (``SLUICE_STREAM_INTERVAL_S``).

Over every factory scenario, with logprobs on some text, joined whole or in pieces cut at random
places: the stream keeps its invariants, ``fold`` (every projector's non-streaming answer) and the
generated token ids are unchanged, and no two joinable deltas are left side by side.
"""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, strategies as st

from shared.accumulate import fold
from shared.events import (
    AnyEvent,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallArgsDelta,
    join_deltas,
    joinable,
)
from tests.factories import SCENARIOS
from tests.invariants import check_stream, generated_token_ids

NAMES = sorted(SCENARIOS)


def with_logprobs(events: list[AnyEvent]) -> list[AnyEvent]:
    """Text deltas with one logprob per token id (what a request with logprobs produces)."""
    return [
        TextDelta(
            text=e.text,
            token_ids=e.token_ids,
            logprobs=[TokenLogprob(token=f"t{t}", logprob=-0.5) for t in e.token_ids],
        )
        if isinstance(e, TextDelta)
        else e
        for e in events
    ]


def pieces(events: list[AnyEvent], cuts: list[bool]) -> list[list[AnyEvent]]:
    out: list[list[AnyEvent]] = [[]]
    for i, event in enumerate(events):
        out[-1].append(event)
        if cuts[i % len(cuts)]:
            out.append([])
    return [p for p in out if p]


@given(
    name=st.sampled_from(NAMES),
    logprobs=st.booleans(),
    cuts=st.lists(st.booleans(), min_size=1, max_size=12),
)
def test_joining_keeps_the_answer_the_tokens_and_the_invariants(
    name: str, logprobs: bool, cuts: list[bool]
) -> None:
    events = SCENARIOS[name]()
    if logprobs:
        events = with_logprobs(events)
    joined = [e for piece in pieces(events, cuts) for e in join_deltas(piece)]
    check_stream(joined)
    assert fold(joined) == fold(events)
    assert generated_token_ids(joined) == generated_token_ids(events)
    whole = join_deltas(events)
    assert not any(joinable(a, b) for a, b in pairwise(whole))


def test_a_run_of_text_becomes_one_delta_with_every_token_and_logprob() -> None:
    lp = [TokenLogprob(token=t, logprob=-1.0) for t in "abc"]
    run: list[AnyEvent] = [
        TextDelta(text="a", token_ids=[1], logprobs=lp[:1]),
        TextDelta(text="bc", token_ids=[2, 3], logprobs=lp[1:]),
    ]
    assert join_deltas(run) == [TextDelta(text="abc", token_ids=[1, 2, 3], logprobs=lp)]


def test_different_kinds_and_different_calls_stay_apart() -> None:
    events: list[AnyEvent] = [
        ReasoningDelta(text="r", token_ids=[1]),
        TextDelta(text="t", token_ids=[2]),
        TextDelta(text="u", token_ids=[3], logprobs=[TokenLogprob(token="u", logprob=0.0)]),
        ToolCallArgsDelta(index=0, fragment="{", token_ids=[4]),
        ToolCallArgsDelta(index=1, fragment="{", token_ids=[5]),
    ]
    assert join_deltas(events) == events
