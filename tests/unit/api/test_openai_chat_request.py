"""Chat Completions request parsing: body -> GenerateRequest, and clear 400s for bad input."""

from __future__ import annotations

import json

import pytest

from services.api.wire.openai_chat import ParsedChat, parse_request as parse_chat_request
from shared.errors import InvalidRequest
from shared.jobs import Message, ReasoningControl, TextPart, ToolCall, ToolChoice, ToolDef

RID = "chatcmpl_test"
USER = {"role": "user", "content": "hi"}


def parse(body: dict[str, object], *, header: bool = False) -> ParsedChat:
    body = {"model": "m", "messages": [USER], **body}
    return parse_chat_request(
        json.dumps(body).encode(), request_id=RID, include_reasoning_header=header
    )


def rejects(body: dict[str, object], param: str | None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(body)
    assert info.value.param == param
    assert info.value.http_status == 400
    return info.value


def test_minimal_body_defaults() -> None:
    parsed = parse({})
    job = parsed.job
    assert (job.request_id, job.model, job.origin) == (RID, "m", "openai_chat")
    assert job.messages == [Message(role="user", content=[TextPart(text="hi")])]
    assert job.max_tokens is None and job.stop == [] and job.tools == []
    assert job.tool_choice == ToolChoice(mode="none")
    assert job.reasoning == ReasoningControl(visible=False, explicit=False)
    assert not parsed.options.stream and not parsed.options.include_usage


def test_every_sampling_parameter_is_carried() -> None:
    parsed = parse(
        {
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "logprobs": True,
            "top_logprobs": 3,
            "ignore_eos": True,
            "min_tokens": 16,
            "user": "u-1",
            "metadata": {"script": "tool_call"},
            "chat_template_kwargs": {"enable_thinking": False, "x": [1]},
            "n": 1,
            "response_format": {"type": "text"},
            "some_unknown_field": {"is": "ignored"},
        }
    )
    job, s = parsed.job, parsed.job.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 40, 0.05, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.logprobs and s.top_logprobs == 3
    assert job.ignore_eos and job.min_tokens == 16
    assert job.user == "u-1" and job.metadata == {"script": "tool_call"}
    assert job.chat_template_kwargs == {"enable_thinking": False, "x": [1]}
    assert job.reasoning.explicit  # the client chose a thinking switch through the template
    assert parsed.options.stream and parsed.options.include_usage


def test_top_k_zero_or_negative_means_disabled() -> None:
    assert parse({"top_k": 0}).job.sampling.top_k is None
    assert parse({"top_k": -1}).job.sampling.top_k is None


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse({"max_tokens": 10}).job.max_tokens == 10
    assert parse({"max_tokens": 10, "max_completion_tokens": 20}).job.max_tokens == 20
    rejects({"max_completion_tokens": 0}, "max_completion_tokens")


def test_stop_string_or_list() -> None:
    assert parse({"stop": "\n\n"}).job.stop == ["\n\n"]
    assert parse({"stop": ["a", "", "b"]}).job.stop == ["a", "b"]
    assert parse({"stop": None}).job.stop == []
    rejects({"stop": 3}, "stop")


@pytest.mark.parametrize(
    ("effort", "mapped"), [("none", "none"), ("low", "low"), ("high", "high"), ("xhigh", "high")]
)
def test_reasoning_effort_maps_to_reasoning_control(effort: str, mapped: str) -> None:
    control = parse({"reasoning_effort": effort}).job.reasoning
    assert control == ReasoningControl(effort=mapped, visible=False, explicit=True)  # type: ignore[arg-type]


def test_reasoning_effort_unknown_is_rejected() -> None:
    rejects({"reasoning_effort": "extreme"}, "reasoning_effort")


def test_reasoning_visible_by_body_flag_or_header() -> None:
    assert not parse({}).options.include_reasoning
    assert parse({"include_reasoning": True}).options.include_reasoning
    assert parse({"include_reasoning": True}).job.reasoning.visible
    by_header = parse({}, header=True)
    assert by_header.options.include_reasoning and by_header.job.reasoning.visible


def test_n_reaches_the_job() -> None:
    # its range (1 to SLUICE_MAX_N) is admission's check, which knows the setting
    assert parse({"n": 3}).job.n == 3 and parse({}).job.n == 1


def test_unsupported_features_are_rejected_clearly() -> None:
    rejects({"response_format": {"type": "xml"}}, "response_format.type")
    rejects({"logit_bias": {"50256": -100}}, "logit_bias")


def test_bad_json_and_wrong_types_are_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_chat_request(b"{not json", request_id=RID)
    assert "`str`" in rejects({"model": 3}, "model").message
    rejects({"messages": [{"role": "user", "content": 5}]}, "messages[0].content")
    with pytest.raises(InvalidRequest, match="model"):
        parse_chat_request(b'{"messages": []}', request_id=RID)
    rejects({"messages": []}, "messages")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("top_p", 1.5),
        ("presence_penalty", -3),
        ("frequency_penalty", 3),
        ("top_logprobs", 21),
        ("repetition_penalty", 0),
        ("min_tokens", -1),
    ],
)
def test_out_of_range_values_name_their_param(field: str, value: float) -> None:
    rejects({field: value, "logprobs": True}, field)


def test_top_logprobs_requires_logprobs() -> None:
    rejects({"top_logprobs": 2}, "top_logprobs")


def test_conversation_with_every_role() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "thinking",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
        {"role": "assistant", "content": "Sunny at noon.", "reasoning": "done"},
    ]
    job = parse({"messages": messages}).job
    assert job.messages == [
        Message(role="system", content=[TextPart(text="Be brief.")]),
        Message(role="system", content=[TextPart(text="Sys")]),
        Message(role="user", content=[TextPart(text="a"), TextPart(text="b")]),
        Message(
            role="assistant",
            reasoning="thinking",
            tool_calls=[
                ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
                ToolCall(id="call_2", name="now", arguments="{}"),
            ],
        ),
        Message(
            role="tool", content=[TextPart(text="sunny")], tool_call_id="call_1", name="get_weather"
        ),
        Message(role="tool", content=[TextPart(text="noon")], tool_call_id="call_2", name="now"),
        Message(role="assistant", content=[TextPart(text="Sunny at noon.")], reasoning="done"),
    ]


def test_bad_messages_name_the_offending_part() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    err = rejects({"messages": [{"role": "user", "content": [image]}]}, "messages[0].content[0]")
    assert "image_url" in err.message
    rejects({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id")
    rejects({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather by city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def test_tools_and_tool_choice() -> None:
    job = parse({"tools": TOOLS, "parallel_tool_calls": False}).job
    assert job.tools == [
        ToolDef(
            name="get_weather",
            description="Weather by city",
            parameters={"type": "object", "properties": {"city": {"type": "string"}}},
        ),
        ToolDef(name="now"),
    ]
    assert job.tool_choice == ToolChoice(mode="auto") and not job.parallel_tool_calls
    for mode in ("none", "auto", "required"):
        assert parse({"tools": TOOLS, "tool_choice": mode}).job.tool_choice.mode == mode
    named = {"type": "function", "function": {"name": "now"}}
    assert parse({"tools": TOOLS, "tool_choice": named}).job.tool_choice == ToolChoice(
        mode="named", name="now"
    )


def test_bad_tools_are_rejected() -> None:
    rejects({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].custom")
    custom = {"type": "custom", "custom": {"name": "x"}}
    rejects(
        {"tools": [custom], "tool_choice": {"type": "custom", "custom": {"name": "x"}}},
        "tool_choice",
    )


def test_custom_tools_are_accepted_and_left_out_of_the_prompt() -> None:
    custom = {"type": "custom", "custom": {"name": "apply_patch", "format": {"type": "text"}}}
    parsed = parse({"tools": [custom, *TOOLS]})
    assert parsed.ignored_tools == ["apply_patch"]
    assert [t.name for t in parsed.job.tools] == [t["function"]["name"] for t in TOOLS]
    rejects({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice")
    rejects({"tool_choice": "required"}, "tool_choice")
    missing = {"type": "function", "function": {"name": "nope"}}
    rejects({"tools": TOOLS, "tool_choice": missing}, "tool_choice")
    rejects({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice")


@pytest.mark.parametrize(("store", "kept"), [(None, True), (True, True), (False, False)])
def test_only_an_explicit_store_false_makes_a_chat_request_unstored(
    store: bool | None, kept: bool
) -> None:
    # OpenAI defaults store to false, but sluice's chat answers are retrievable by id unless
    # the client opts out: the README promises it.
    assert parse({} if store is None else {"store": store}).job.store is kept


@pytest.mark.parametrize(("value", "inline"), [("inline", True), ("none", True), ("auto", False)])
def test_reasoning_format_inline_shows_reasoning_in_content(value: str, inline: bool) -> None:
    """llama.cpp's "none" is the same raw, inline form; "inline" also makes reasoning visible
    (it is shown, only elsewhere), and is kept on the job so a replay shows it the same way."""
    parsed = parse({"reasoning_format": value})
    assert parsed.job.reasoning.inline is inline
    assert parsed.options.include_reasoning is inline and parsed.job.reasoning.visible is inline
    assert "reasoning_format" not in parsed.ignored_fields


def test_an_unknown_reasoning_format_is_refused() -> None:
    assert "inline" in rejects({"reasoning_format": "raw"}, "reasoning_format").message


def test_speculative_false_opts_the_request_out() -> None:
    """sluice's extension field: declared, so it is not listed as ignored."""
    assert parse({}).job.speculative is True
    parsed = parse({"speculative": False})
    assert parsed.job.speculative is False and "speculative" not in parsed.ignored_fields
