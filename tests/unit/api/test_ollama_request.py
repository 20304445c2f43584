"""Ollama request parsing: bodies into jobs, and the 400s for what sluice cannot honour."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.api.wire.ollama import error_body, parse_chat, parse_generate, ps_body, show_body
from services.worker.scripted import parse_spec
from shared.errors import InvalidRequest, ModelNotFound, Overloaded
from shared.jobs import ToolCall


def chat(**body: Any) -> Any:
    body.setdefault("model", "m")
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat(json.dumps(body).encode(), request_id="r1")


def generate(**body: Any) -> Any:
    body.setdefault("model", "m")
    return parse_generate(json.dumps(body).encode(), request_id="r1")


def test_chat_defaults_to_streaming_and_maps_the_conversation() -> None:
    parsed = chat(
        messages=[
            {"role": "system", "content": "be terse"},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "thinking": "look it up",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
                ],
            },
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        ],
        keep_alive="5m",
    )
    job = parsed.job
    assert parsed.stream and not parsed.load_only and job.origin == "ollama"
    assert [m.role for m in job.messages] == ["system", "user", "assistant", "tool"]
    assistant, tool = job.messages[2], job.messages[3]
    assert assistant.reasoning == "look it up"
    assert assistant.tool_calls == [
        ToolCall(id="call_2_0", name="get_weather", arguments='{"city":"Oslo"}')
    ]
    assert (tool.tool_call_id, tool.name) == ("call_2_0", "get_weather")


def test_stream_false_and_options() -> None:
    options = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.05,
        "seed": 7,
        "repeat_penalty": 1.1,
        "num_predict": 32,
        "stop": ["\n\n"],
        "num_ctx": 4096,
        "num_gpu": 99,  # a runner option: accepted and ignored
        "mirostat": 2,
    }
    parsed = chat(stream=False, options=options)
    job = parsed.job
    assert not parsed.stream and parsed.num_ctx == 4096
    s = job.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, None, 0.05, 7)
    assert s.repetition_penalty == 1.1
    assert job.max_tokens == 32 and job.stop == ["\n\n"]


@pytest.mark.parametrize("num_predict", [-1, -2, 0])
def test_num_predict_sentinels_mean_no_limit(num_predict: int) -> None:
    assert chat(options={"num_predict": num_predict}).job.max_tokens is None


def test_a_negative_seed_is_random() -> None:
    assert chat(options={"seed": -1}).job.sampling.seed is None


@pytest.mark.parametrize(
    ("think", "effort", "visible"),
    [(None, None, True), (True, None, True), (False, "none", False), ("high", "high", True)],
)
def test_think(think: object, effort: str | None, visible: bool) -> None:
    body = {} if think is None else {"think": think}
    reasoning = chat(**body).job.reasoning
    assert (reasoning.effort, reasoning.visible, reasoning.explicit) == (
        effort,
        visible,
        think is not None,
    )


def test_format_json_and_schema() -> None:
    assert chat(format="json").job.constraint.kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constraint = chat(format=schema).job.constraint
    assert constraint.kind == "json_schema" and constraint.json_schema == schema
    assert chat(format="").job.constraint is None


def test_tools() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    job = chat(tools=[tool]).job
    assert [t.name for t in job.tools] == ["get_weather"] and job.tool_choice.mode == "auto"


def test_generate_renders_system_and_prompt_as_messages() -> None:
    parsed = generate(prompt="why?", system="be brief", stream=False, think=False)
    assert [(m.role, m.text) for m in parsed.job.messages] == [
        ("system", "be brief"),
        ("user", "why?"),
    ]
    assert not parsed.stream


def test_without_a_prompt_or_messages_it_only_loads() -> None:
    assert generate().load_only
    assert chat(messages=[]).load_only


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"not json", None),
        (b'{"messages": []}', "model"),
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (b'{"model": "m", "format": "xml"}', "format"),
        (b'{"model": "m", "options": {"temperature": 9}}', "options.temperature"),
        (b'{"model": "m", "options": {"top_k": -1}}', "options.top_k"),
        (b'{"model": "m", "options": {"num_ctx": 0}}', "options.num_ctx"),
        (b'{"model": "m", "think": "deep"}', "think"),
        (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}',
            "messages[0].images",
        ),
        (b'{"model": "m", "tools": [{"type": "retrieval"}]}', "tools[0]"),
    ],
)
def test_chat_rejections_name_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_chat(body, request_id="r1")
    if param is not None:
        assert err.value.param == param


@pytest.mark.parametrize("field", ["raw", "suffix", "template", "context", "images"])
def test_generate_refuses_what_would_change_the_answer(field: str) -> None:
    value: object = {"raw": True, "suffix": "}", "template": "{{ .Prompt }}"}.get(field, [1])
    if field == "images":
        value = ["aGk="]
    with pytest.raises(InvalidRequest) as err:
        generate(prompt="x", **{field: value})
    assert err.value.param == field


def test_error_body_is_ollamas() -> None:
    assert error_body(InvalidRequest("bad")) == (400, {"error": "bad"})
    assert error_body(ModelNotFound("model 'x' not found")) == (
        404,
        {"error": "model 'x' not found"},
    )
    assert error_body(Overloaded("busy"))[0] == 503


def test_show_and_ps_from_the_card() -> None:
    card = parse_spec("scripted:reasoning").card
    show = show_body(card)
    assert show["capabilities"] == ["completion", "tools", "thinking"]
    info = show["model_info"]
    assert info[f"{card.architecture}.context_length"] == card.context_length  # type: ignore[index]
    (loaded,) = ps_body([card])["models"]  # type: ignore[misc]
    assert loaded["context_length"] == card.context_length and loaded["name"] == card.name
