"""Whitespace between markers is not content, in every format, streamed and folded.

A reasoning model calling a tool writes ``<think>…</think>\\n\\n<tool_call>…``; the ``\\n\\n``
reaches the API as a ``TextDelta``. Chat must answer ``content: null``, Responses must not add a
whitespace ``message`` item, Anthropic must not add a whitespace ``text`` block; the same holds
for whitespace between parallel calls and before the end.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from services.api.wire import anthropic_messages, openai_chat, openai_responses
from shared.accumulate import fold
from shared.events import (
    AnyEvent,
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
from shared.separators import SeparatorGate
from tests.invariants import check_stream

RID = "resp_00000000000000000000beef"


def _call(index: int) -> list[AnyEvent]:
    return [
        ToolCallStart(index=index, call_id=f"call_{index}", name="get_weather", token_ids=[1]),
        ToolCallArgsDelta(index=index, fragment='{"city": "Oslo"}', token_ids=[2]),
        ToolCallEnd(index=index, arguments='{"city": "Oslo"}', token_ids=[3]),
    ]


def _stream(*body: AnyEvent, reason: Any = "tool_use") -> list[AnyEvent]:
    events: list[AnyEvent] = [
        Start(request_id=RID, model="m", prompt_tokens=4),
        *body,
        Usage(input_tokens=4, output_tokens=9),
        Finish(reason=reason, token_ids=[9]),
    ]
    check_stream(events)
    return events


THINK_THEN_CALLS = _stream(
    ReasoningDelta(text="Need the weather.", token_ids=[5]),
    ReasoningEnd(token_ids=[6]),
    TextDelta(text="\n\n", token_ids=[7]),
    *_call(0),
    TextDelta(text="\n", token_ids=[8]),
    *_call(1),
    TextDelta(text="\n", token_ids=[10]),
)
THINK_THEN_ANSWER = _stream(
    ReasoningDelta(text="Easy.", token_ids=[5]),
    ReasoningEnd(token_ids=[6]),
    TextDelta(text="\n", token_ids=[7]),
    TextDelta(text="\nParis", token_ids=[8]),
    TextDelta(text=" is it.\n", token_ids=[10]),
    reason="end_turn",
)


def _texts(events: list[AnyEvent]) -> list[str]:
    gate = SeparatorGate()
    return [e.text for raw in events for e in gate.feed(raw) if isinstance(e, TextDelta)]


def test_gate_drops_separators_and_keeps_text_that_is_text() -> None:
    assert _texts(THINK_THEN_CALLS) == []
    assert _texts(THINK_THEN_ANSWER) == ["Paris", " is it.\n"]
    only_space = _stream(TextDelta(text="  ", token_ids=[5]), reason="end_turn")
    assert _texts(only_space) == ["  "]  # no marker anywhere: the model's own answer
    before_call = _stream(TextDelta(text="\n", token_ids=[5]), *_call(0))
    assert _texts(before_call) == []
    lead = _stream(TextDelta(text=" ", token_ids=[5]), TextDelta(text="Hi", token_ids=[7]))
    assert _texts(lead) == [" ", "Hi"]  # the answer's own leading space, no marker near it
    assert fold(THINK_THEN_ANSWER).text == "Paris is it.\n"


def _sse(projector: Any, events: list[AnyEvent]) -> list[Any]:
    frames = [f for e in events for f in projector.feed(e)] + projector.close()
    return [json.loads(f.data) for f in frames if f.data.startswith(b"{")]


def test_chat_tool_call_after_thinking_has_null_content() -> None:
    ctx = openai_chat.Context(id="chatcmpl-1", created=1, model="m", include_reasoning=True)
    chunks = _sse(openai_chat.Projector(ctx), THINK_THEN_CALLS)
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert not any(contents), contents
    body = json.loads(msgspec.json.encode(openai_chat.render(fold(THINK_THEN_CALLS), ctx)))
    message = body["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 2
    answer = json.loads(msgspec.json.encode(openai_chat.render(fold(THINK_THEN_ANSWER), ctx)))
    assert answer["choices"][0]["message"]["content"] == "Paris is it.\n"


def _responses_skeleton() -> Any:
    req = openai_responses.parse_request(b'{"model": "m", "input": "x"}')
    return openai_responses.skeleton(req, RID, 1)


@pytest.mark.parametrize(
    ("events", "types"),
    [
        (THINK_THEN_CALLS, ["reasoning", "function_call", "function_call"]),
        (THINK_THEN_ANSWER, ["reasoning", "message"]),
    ],
)
def test_responses_has_no_whitespace_message_item(events: list[AnyEvent], types: list[str]) -> None:
    skeleton = _responses_skeleton()
    streamed = _sse(openai_responses.Projector(openai_responses.Context(skeleton=skeleton)), events)
    added = [e["item"]["type"] for e in streamed if e["type"] == "response.output_item.added"]
    folded = json.loads(msgspec.json.encode(openai_responses.render(fold(events), skeleton)))
    assert added == [item["type"] for item in folded["output"]] == types
    assert streamed[-1]["response"] == folded


@pytest.mark.parametrize(
    ("events", "types"),
    [
        (THINK_THEN_CALLS, ["thinking", "tool_use", "tool_use"]),
        (THINK_THEN_ANSWER, ["thinking", "text"]),
    ],
)
def test_anthropic_has_no_whitespace_text_block(events: list[AnyEvent], types: list[str]) -> None:
    ctx = anthropic_messages.Context(message_id="msg_1", model="m")
    streamed = _sse(anthropic_messages.Projector(ctx), events)
    started = [e["content_block"]["type"] for e in streamed if e["type"] == "content_block_start"]
    folded = json.loads(msgspec.json.encode(anthropic_messages.render(fold(events), ctx)))
    assert started == [block["type"] for block in folded["content"]] == types
