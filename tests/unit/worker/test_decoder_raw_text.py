"""A raw-text job (legacy completions) decodes without reasoning routing or tool-call parsing."""

from __future__ import annotations

from shared.accumulate import fold
from shared.events import ReasoningDelta, ToolCallStart
from tests.unit.worker.decoder_harness import (
    CALL,
    END_CALL,
    END_THINK,
    EOS,
    THINK,
    drive,
    ids,
    make_job,
)


def test_reasoning_markers_stay_in_the_text() -> None:
    script = [THINK, *ids("hmm"), END_THINK, *ids("ok"), EOS]
    events = drive(script, job=make_job(raw_text=True))
    assert not any(isinstance(e, ReasoningDelta) for e in events)
    done = fold(events)
    assert done.text == "<think>hmm</think>ok"
    assert done.usage is not None and done.usage.reasoning_tokens == 0


def test_a_prompt_left_inside_reasoning_is_ignored() -> None:
    events = drive(
        [*ids("hmm"), END_THINK, EOS], job=make_job(raw_text=True), starts_in_reasoning=True
    )
    assert fold(events).text == "hmm</think>"


def test_tool_call_markup_stays_in_the_text() -> None:
    body = '{"name": "get_weather", "arguments": {}}'
    events = drive([CALL, *ids(body), END_CALL, EOS], job=make_job(raw_text=True))
    assert not any(isinstance(e, ToolCallStart) for e in events)
    assert fold(events).text == f"<tool_call>{body}</tool_call>"
