"""Unit tests of Anthropic Messages request parsing into the canonical job."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.api.wire.anthropic_messages import (
    build_job,
    ignored_tools,
    parse_count_tokens_request,
    parse_request as parse_messages_request,
)
from shared.errors import InvalidRequest
from shared.jobs import GenerateRequest, Message, ReasoningControl, TextPart, ToolCall, ToolChoice


def body(**fields: Any) -> bytes:
    base: dict[str, Any] = {
        "model": "tiny-test",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    return json.dumps({**base, **fields}).encode()


def job(**fields: Any) -> GenerateRequest:
    return build_job(parse_messages_request(body(**fields)), request_id="msg_1")


def rejected(raw: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        build_job(parse_messages_request(raw), request_id="msg_1")
    return raised.value


def user(text: str) -> Message:
    return Message(role="user", content=[TextPart(text=text)])


def test_minimal_request() -> None:
    j = job()
    assert j.origin == "anthropic_messages"
    assert j.request_id == "msg_1"
    assert j.model == "tiny-test"
    assert j.max_tokens == 64
    assert j.messages == [user("Hi")]
    assert j.reasoning == ReasoningControl()
    assert j.tool_choice == ToolChoice(mode="auto") and j.parallel_tool_calls


def test_system_as_string_and_as_blocks() -> None:
    assert job(system="Be brief.").messages[0] == Message(
        role="system", content=[TextPart(text="Be brief.")]
    )
    blocks = [
        {"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "B"},
    ]
    assert job(system=blocks).messages[0] == Message(role="system", content=[TextPart(text="A\nB")])


def test_system_role_inside_messages_is_kept_in_place() -> None:
    messages = [
        {"role": "user", "content": "one"},
        {"role": "system", "content": "mid-conversation instruction"},
        {"role": "user", "content": "two"},
    ]
    assert [m.role for m in job(messages=messages).messages] == ["user", "system", "user"]


def test_tool_loop_with_thinking_replay() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need a tool.", "signature": ""},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "21C"}],
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": "no such tool",
                    "is_error": True,
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    got = job(messages=messages).messages
    assert got[1] == Message(
        role="assistant",
        content=[TextPart(text="Checking.")],
        tool_calls=[ToolCall(id="toolu_1", name="get_weather", arguments='{"city":"Paris"}')],
        reasoning="Need a tool.",
    )
    assert got[2] == Message(
        role="tool", content=[TextPart(text="21C")], tool_call_id="toolu_1", name="get_weather"
    )
    assert got[3] == Message(
        role="tool", content=[TextPart(text="no such tool")], tool_call_id="toolu_2", is_error=True
    )
    assert got[4] == user("Thanks")


@pytest.mark.parametrize(
    "block",
    [
        {"type": "thinking", "thinking": "t", "signature": ""},
        {"type": "thinking", "thinking": "t", "signature": "EsQDCkYIBxgCKkA-foreign"},
        {"type": "thinking", "thinking": "t"},
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "redacted_thinking", "data": ""},
    ],
)
def test_thinking_blocks_with_any_signature_are_accepted(block: dict[str, Any]) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [block, {"type": "text", "text": "a"}]},
        {"role": "user", "content": "more"},
    ]
    assert job(messages=messages).messages[1].text == "a"


def test_consecutive_turns_of_one_role_are_merged() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]},
        {"role": "assistant", "content": "c"},
    ]
    got = job(messages=messages).messages
    assert got == [
        user("a\nb"),
        Message(role="assistant", content=[TextPart(text="c")], reasoning="x"),
    ]


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, ToolChoice(mode="auto"), True),
        ({"type": "any"}, ToolChoice(mode="required"), True),
        ({"type": "tool", "name": "f"}, ToolChoice(mode="named", name="f"), True),
        ({"type": "none"}, ToolChoice(mode="none"), True),
        ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice(mode="auto"), False),
        (
            {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
            ToolChoice(mode="named", name="f"),
            False,
        ),
    ],
)
def test_tools_and_tool_choice(
    choice: dict[str, Any], expected: ToolChoice, parallel: bool
) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    j = job(tools=[{"name": "f", "description": "d", "input_schema": schema}], tool_choice=choice)
    assert (
        j.tools[0].name == "f" and j.tools[0].parameters == schema and j.tools[0].description == "d"
    )
    assert j.tool_choice == expected
    assert j.parallel_tool_calls is parallel


@pytest.mark.parametrize(
    ("thinking", "expected"),
    [
        (
            {"type": "enabled", "budget_tokens": 2048},
            ReasoningControl(budget_tokens=2048, explicit=True),
        ),
        (
            {"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
            ReasoningControl(budget_tokens=1024, visible=False, explicit=True),
        ),
        ({"type": "disabled"}, ReasoningControl(effort="none", explicit=True)),
        ({"type": "adaptive"}, ReasoningControl(explicit=True)),
    ],
)
def test_thinking_maps_to_reasoning_control(
    thinking: dict[str, Any], expected: ReasoningControl
) -> None:
    assert job(thinking=thinking).reasoning == expected


def test_output_config_effort() -> None:
    got = job(thinking={"type": "adaptive"}, output_config={"effort": "max"}).reasoning
    assert got == ReasoningControl(effort="high", explicit=True)


def test_sampling_stop_and_metadata() -> None:
    j = job(
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        stop_sequences=["###", "END"],
        metadata={"user_id": "u-1", "script": "tool_call"},
        service_tier="auto",  # unknown fields are accepted and ignored
        container=None,
    )
    assert (j.sampling.temperature, j.sampling.top_p, j.sampling.top_k) == (0.2, 0.9, 40)
    assert j.stop == ["###", "END"]
    assert j.user == "u-1"
    assert j.metadata == {"script": "tool_call"}
    assert job(top_k=0).sampling.top_k is None


def test_max_tokens_is_required_for_create_but_not_for_count_tokens() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    err = rejected(raw)
    assert err.param == "max_tokens" and "max_tokens" in err.message
    assert parse_count_tokens_request(raw).max_tokens is None


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (b"{not json", None, "not valid JSON"),
        (body(max_tokens=0), "max_tokens", ">= 1"),
        (body(messages="hi"), "messages", "Expected `array`"),
        (json.dumps({"max_tokens": 5, "messages": []}).encode(), "model", "Field required"),
        (body(messages=[{"role": "bot", "content": "x"}]), "messages[0].role", "bot"),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            "messages[0].content[0]",
            "supported content block types: text, tool_use",
        ),
        (
            body(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ]
            ),
            "messages[0].content[0]",
            "not allowed in a user turn",
        ),
        (
            body(
                messages=[
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
                ]
            ),
            "messages[0].content[0]",
            "belong in a user turn",
        ),
        (
            body(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image"}],
                            }
                        ],
                    }
                ]
            ),
            "messages[0].content[0].content[0]",
            "supported content block types: text",
        ),
        (body(tool_choice={"type": "sometimes"}), "tool_choice.type", "sometimes"),
        (body(temperature=1.5), "temperature", "<= 1.0"),
        (body(top_p=0), "top_p", "> 0.0"),
        (body(stop_sequences=[" "]), "stop_sequences[0]", "non-whitespace"),
        (body(thinking={"type": "enabled", "budget_tokens": 0}), "thinking.budget_tokens", ">= 1"),
        (body(thinking={"type": "enabled"}), "thinking.budget_tokens", "Field required"),
        (body(thinking={"type": "sometimes"}), "thinking.type", "sometimes"),
        (body(tool_choice={"type": "any"}), "tool_choice", "requires tools"),
        (
            body(
                tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "tool", "name": "g"}
            ),
            "tool_choice.name",
            "no tool named 'g'",
        ),
        (
            body(
                tools=[{"type": "web_search_20250305", "name": "web_search"}],
                tool_choice={"type": "tool", "name": "web_search"},
            ),
            "tool_choice.name",
            "server tool",
        ),
        (
            body(output_config={"format": {"type": "json_schema", "schema": {"not": {}}}}),
            "output_config.format.schema",
            "Unimplemented keys",
        ),
        (
            body(output_config={"format": {"type": "json_object"}}),
            "output_config.format.type",
            "json_schema",
        ),
        (
            body(
                tools=[{"name": "f", "input_schema": {"type": "strnig"}}],
                tool_choice={"type": "any"},
            ),
            "tools[0].input_schema",
            "strnig",
        ),
    ],
)
def test_bad_input_is_a_clear_invalid_request(raw: bytes, param: str | None, fragment: str) -> None:
    err = rejected(raw)
    assert err.param == param
    assert fragment in err.message


def test_server_tools_are_accepted_and_left_out_of_the_prompt() -> None:
    req = parse_messages_request(
        body(
            tools=[
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                {"name": "f", "input_schema": {"type": "object"}},
                {"type": "code_execution_20250825", "name": "code_execution"},
            ]
        )
    )
    assert ignored_tools(req) == ["web_search", "code_execution"]
    assert [t.name for t in build_job(req, request_id="msg_1").tools] == ["f"]
