"""Event-list scenarios shared by projector, golden and conformance tests.

Plain functions; each returns a complete stream that satisfies ``tests.invariants.check_stream``.
Token ids are small fake ids: projectors never look at them.
"""

from __future__ import annotations

from shared.events import (
    AnyEvent,
    Error,
    Finish,
    ReasoningDelta,
    ReasoningEnd,
    Start,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)

__all__ = ["SCENARIOS"]

RID = "req_0000000000000001"
MODEL = "tiny-test"


def _start(prompt_tokens: int = 12) -> Start:
    return Start(request_id=RID, model=MODEL, prompt_tokens=prompt_tokens, cached_tokens=4)


def text_only() -> list[AnyEvent]:
    return [
        _start(),
        TextDelta(text="Hello", token_ids=[10]),
        TextDelta(text=", world", token_ids=[11, 12]),
        TextDelta(text="!", token_ids=[13]),
        Usage(input_tokens=12, output_tokens=5, cached_tokens=4),
        Finish(reason="end_turn", token_ids=[2]),
    ]


def reasoning_then_text() -> list[AnyEvent]:
    return [
        _start(),
        ReasoningDelta(text="The user greets", token_ids=[100, 20, 21]),
        ReasoningDelta(text=" me.", token_ids=[22]),
        ReasoningEnd(token_ids=[101]),
        TextDelta(text="Hi there.", token_ids=[23, 24]),
        Usage(input_tokens=12, output_tokens=7, cached_tokens=4, reasoning_tokens=4),
        Finish(reason="end_turn", token_ids=[2]),
    ]


def one_tool_call() -> list[AnyEvent]:
    return [
        _start(),
        ToolCallStart(index=0, call_id="call_a1", name="get_weather", token_ids=[200, 30]),
        ToolCallArgsDelta(index=0, fragment='{"city": ', token_ids=[31]),
        ToolCallArgsDelta(index=0, fragment='"Paris"}', token_ids=[32, 33]),
        ToolCallEnd(index=0, arguments='{"city": "Paris"}', token_ids=[201]),
        Usage(input_tokens=12, output_tokens=6, cached_tokens=4),
        Finish(reason="tool_use", token_ids=[2]),
    ]


def reasoning_then_tool_call() -> list[AnyEvent]:
    events = one_tool_call()
    return [
        events[0],
        ReasoningDelta(text="Need the weather.", token_ids=[100, 40]),
        ReasoningEnd(token_ids=[101]),
        *events[1:-2],
        Usage(input_tokens=12, output_tokens=8, cached_tokens=4, reasoning_tokens=2),
        events[-1],
    ]


def parallel_tool_calls() -> list[AnyEvent]:
    return [
        _start(),
        TextDelta(text="Checking both.", token_ids=[50]),
        ToolCallStart(index=0, call_id="call_a1", name="get_weather", token_ids=[200, 30]),
        ToolCallArgsDelta(index=0, fragment='{"city": "Paris"}', token_ids=[31]),
        ToolCallEnd(index=0, arguments='{"city": "Paris"}', token_ids=[201]),
        ToolCallStart(index=1, call_id="call_b2", name="get_weather", token_ids=[200, 30]),
        ToolCallArgsDelta(index=1, fragment='{"city": ', token_ids=[34]),
        ToolCallArgsDelta(index=1, fragment='"Oslo"}', token_ids=[35]),
        ToolCallEnd(index=1, arguments='{"city": "Oslo"}', token_ids=[201]),
        Usage(input_tokens=12, output_tokens=10, cached_tokens=4),
        Finish(reason="tool_use", token_ids=[2]),
    ]


def parameterless_tool_call() -> list[AnyEvent]:
    return [
        _start(),
        ToolCallStart(index=0, call_id="call_c3", name="get_time", token_ids=[200, 36]),
        ToolCallArgsDelta(index=0, fragment="{}", token_ids=[37]),
        ToolCallEnd(index=0, arguments="{}", token_ids=[201]),
        Usage(input_tokens=12, output_tokens=4, cached_tokens=4),
        Finish(reason="tool_use", token_ids=[2]),
    ]


def max_tokens() -> list[AnyEvent]:
    return [
        _start(),
        TextDelta(text="Once upon", token_ids=[60, 61]),
        TextDelta(text=" a time", token_ids=[62, 63]),
        Usage(input_tokens=12, output_tokens=4, cached_tokens=4),
        Finish(reason="max_tokens"),
    ]


def stop_sequence() -> list[AnyEvent]:
    return [
        _start(),
        TextDelta(text="1, 2, 3", token_ids=[70, 71, 72]),
        Usage(input_tokens=12, output_tokens=5, cached_tokens=4),
        Finish(reason="stop_sequence", stop_sequence="4", token_ids=[73, 74]),
    ]


def error_mid_stream() -> list[AnyEvent]:
    return [
        _start(),
        TextDelta(text="Partial", token_ids=[80]),
        Error(kind="internal", message="CUDA error: device-side assert triggered", retryable=True),
    ]


def error_before_start() -> list[AnyEvent]:
    return [Error(kind="overloaded", message="no worker took the request in time", retryable=True)]


def cancelled_before_start() -> list[AnyEvent]:
    # what a worker publishes for a job whose cancel flag was up before it started it
    return [Error(kind="cancelled", message="cancelled before generation started")]


SCENARIOS = {
    "text": text_only,
    "reasoning": reasoning_then_text,
    "tool_call": one_tool_call,
    "reasoning_tool_call": reasoning_then_tool_call,
    "parallel_tool_calls": parallel_tool_calls,
    "parameterless_tool_call": parameterless_tool_call,
    "max_tokens": max_tokens,
    "stop_sequence": stop_sequence,
    "error": error_mid_stream,
    "error_before_start": error_before_start,
    "cancelled_before_start": cancelled_before_start,
}
