"""Parsing /v1/responses bodies into jobs and conversations (pure: no app, no Redis)."""

from __future__ import annotations

import json

import pytest

from services.api.wire.openai_responses import (
    build_job,
    input_messages,
    items_to_messages,
    parse_request,
    skeleton,
)
from shared.errors import InvalidRequest
from shared.jobs import GenerateRequest, Message, TextPart, ToolCall

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def _job(body: dict[str, object], history: list[Message] | None = None) -> GenerateRequest:
    req = parse_request(json.dumps(body).encode())
    conv = input_messages(req, history or [])
    return build_job(req, request_id="resp_1", conversation=conv, owner="o", created=1.0)


def _invalid(body: object) -> InvalidRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()

    def parse_all() -> None:
        req = parse_request(raw)
        input_messages(req)
        skeleton(req, "resp_1", 0)

    with pytest.raises(InvalidRequest) as info:
        parse_all()
    return info.value


def test_string_input_with_instructions_becomes_system_then_user() -> None:
    job = _job({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9})
    assert [m.role for m in job.messages] == ["system", "user"]
    assert job.messages[0].text == "Be brief."
    assert job.messages[1].text == "Hi"
    assert job.origin == "openai_responses"
    assert job.request_id == "resp_1"
    assert job.max_tokens == 9


def test_sampling_reasoning_metadata_and_logprobs_are_mapped() -> None:
    job = _job(
        {
            "model": "m",
            "input": "x",
            "temperature": 0.5,
            "top_p": 0.9,
            "reasoning": {"effort": "xhigh", "summary": "auto"},
            "metadata": {"script": "reasoning"},
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 3,
            "parallel_tool_calls": False,
            "user": "u1",
        }
    )
    assert job.sampling.temperature == 0.5
    assert job.sampling.top_p == 0.9
    assert job.sampling.logprobs is True
    assert job.sampling.top_logprobs == 3
    assert job.reasoning.effort == "high"
    assert job.reasoning.explicit is True
    assert job.metadata == {"script": "reasoning"}
    assert job.parallel_tool_calls is False
    assert job.user == "u1"


def test_tool_loop_items_fold_into_assistant_and_tool_turns() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {
            "type": "reasoning",
            "id": "rs_x",
            "summary": [{"type": "summary_text", "text": "summary"}],
            "content": [{"type": "reasoning_text", "text": "Need weather."}],
            "encrypted_content": "gAAAA-foreign-blob",
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
    ]
    job = _job({"model": "m", "input": items, "tools": [WEATHER]})
    user, assistant, tool1, tool2 = job.messages
    assert user == Message(role="user", content=[TextPart(text="Weather in Paris?")])
    assert assistant.role == "assistant"
    assert assistant.text == "Checking."
    assert assistant.reasoning == "Need weather."
    assert assistant.tool_calls == [
        ToolCall(id="call_1", name="get_weather", arguments="{}"),
        ToolCall(id="call_2", name="get_time", arguments="{}"),
    ]
    assert (tool1.role, tool1.tool_call_id, tool1.name, tool1.text) == (
        "tool",
        "call_1",
        "get_weather",
        "18 C",
    )
    assert (tool2.tool_call_id, tool2.name, tool2.text) == ("call_2", "get_time", "noon")
    assert [t.name for t in job.tools] == ["get_weather"]
    assert job.tools[0].parameters == WEATHER["parameters"]


def test_foreign_encrypted_reasoning_alone_is_accepted_and_ignored() -> None:
    items = [
        {"role": "user", "content": "Q1"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "function_call", "call_id": "call_9", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "ok"},
        {"role": "developer", "content": "Dev note"},
    ]
    job = _job({"model": "m", "input": items})
    assert [m.role for m in job.messages] == ["user", "assistant", "tool", "system"]
    assert job.messages[1].reasoning is None
    assert job.messages[1].tool_calls[0].id == "call_9"


def test_history_precedes_input_and_names_earlier_calls() -> None:
    history = [
        Message(role="user", content=[TextPart(text="Q")]),
        Message(
            role="assistant", tool_calls=[ToolCall(id="call_7", name="lookup", arguments="{}")]
        ),
    ]
    items = [{"type": "function_call_output", "call_id": "call_7", "output": "42"}]
    job = _job({"model": "m", "input": items, "instructions": "Sys"}, history)
    assert [m.role for m in job.messages] == ["system", "user", "assistant", "tool"]
    assert job.messages[3].name == "lookup"


def test_output_items_replay_as_one_assistant_turn() -> None:
    output: list[dict[str, object]] = [
        {"type": "reasoning", "id": "rs_a_0", "summary": [], "content": [], "status": "completed"},
        {
            "type": "message",
            "id": "msg_a_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
        },
    ]
    messages = items_to_messages(output, [Message(role="user", content=[TextPart(text="Hi")])])
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].text == "Hello"
    assert messages[1].reasoning is None


def test_tool_choice_forms() -> None:
    job = _job({"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": "required"})
    assert job.tool_choice.mode == "required"
    body = {"model": "m", "input": "x", "tools": [WEATHER]}
    job = _job({**body, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert (job.tool_choice.mode, job.tool_choice.name) == ("named", "get_weather")
    other = {**WEATHER, "name": "other"}
    allowed = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "other"}],
    }
    job = _job({**body, "tools": [WEATHER, other], "tool_choice": allowed})
    assert [t.name for t in job.tools] == ["other"]
    req = parse_request(
        json.dumps({**body, "tool_choice": {"type": "function", "name": "get_weather"}}).encode()
    )
    assert skeleton(req, "resp_1", 5).tool_choice == {"type": "function", "name": "get_weather"}


def test_skeleton_echoes_request_parameters() -> None:
    body = {
        "model": "m",
        "input": "x",
        "instructions": "I",
        "tools": [WEATHER],
        "temperature": 0.2,
        "store": False,
        "previous_response_id": "resp_prev",
        "metadata": {"k": "v"},
        "reasoning": {"effort": "low", "generate_summary": "concise"},
    }
    sk = skeleton(parse_request(json.dumps(body).encode()), "resp_1", 123)
    assert (sk.id, sk.created_at, sk.status, sk.output, sk.usage) == (
        "resp_1",
        123,
        "in_progress",
        [],
        None,
    )
    assert (sk.instructions, sk.temperature, sk.store, sk.previous_response_id) == (
        "I",
        0.2,
        False,
        "resp_prev",
    )
    assert sk.tools == [WEATHER]
    assert (sk.reasoning.effort, sk.reasoning.summary) == ("low", "concise")
    assert sk.metadata == {"k": "v"}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"{not json", None, "not valid JSON"),
        ({"input": "x"}, None, "model"),
        ({"model": "m", "input": "x", "max_output_tokens": "ten"}, "max_output_tokens", "int"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"model": "m", "input": "x", "temperature": 3}, "temperature", "between"),
        (
            {"model": "m", "input": "x", "reasoning": {"effort": "huge"}},
            "reasoning.effort",
            "one of",
        ),
        ({"model": "m"}, "input", "required"),
        (
            {"model": "m", "input": "x", "metadata": {str(i): "v" for i in range(17)}},
            "metadata",
            "at most 16",
        ),
        ({"model": "m", "input": "x", "metadata": {"k": 1}}, "metadata", "str"),
        ({"model": "m", "input": 5}, "input", "Expected"),
        (
            {"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
            "text.format.schema",
            "required",
        ),
        (
            {"model": "m", "input": "x", "tools": [{"type": "web_searcher"}]},
            "tools[0].type",
            "Unsupported tool type",
        ),
        ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0]", "name"),
        (
            {"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice.name",
            "not in 'tools'",
        ),
        (
            {"model": "m", "input": [{"type": "item_reference", "id": "x"}]},
            "input[0].type",
            "not supported",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
            "text-only",
        ),
        ({"model": "m", "input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "Invalid"),
        (
            {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
            "input[0]",
            "call_id",
        ),
        ({"model": "m", "input": "x", "background": True, "store": False}, "store", "stored"),
        ({"model": "m", "input": "x", "background": True, "stream": True}, "stream", "GET"),
        (
            {"model": "m", "input": "x", "conversation": "conv_1"},
            "conversation",
            "previous_response_id",
        ),
    ],
)
def test_bad_input_is_invalid_request_with_param(
    body: object, param: str | None, words: str
) -> None:
    err = _invalid(body)
    assert err.http_status == 400
    assert err.param == param
    assert words in err.message


def test_unknown_fields_are_ignored() -> None:
    job = _job({"model": "m", "input": "x", "service_tier": "auto", "prompt_cache_key": "k"})
    assert job.messages[0].text == "x"


@pytest.mark.parametrize(("store", "kept"), [(None, True), (True, True), (False, False)])
def test_responses_store_reaches_the_job(store: bool | None, kept: bool) -> None:
    body: dict[str, object] = {"model": "m", "input": "hi"}
    assert _job(body if store is None else body | {"store": store}).store is kept
