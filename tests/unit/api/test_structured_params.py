"""Structured-output parameters of the three wire formats become one ``Constraint`` on the job.

Bad ones are 400s naming the parameter in the format's own terms; strict tools keep ``strict``;
the Responses echo carries the requested ``text.format``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from services.api.wire import anthropic_messages, openai_chat, openai_responses
from shared.errors import InvalidRequest
from shared.jobs import Constraint, GenerateRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integr"}}}
USER = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> GenerateRequest:
    raw = json.dumps({"model": "m", "messages": [USER], **fields}).encode()
    return openai_chat.parse_request(raw, request_id="c").job


def responses(**fields: Any) -> tuple[GenerateRequest, dict[str, Any]]:
    req = openai_responses.parse_request(
        json.dumps({"model": "m", "input": "hi", **fields}).encode()
    )
    conversation = openai_responses.input_messages(req)
    job = openai_responses.build_job(
        req, request_id="resp_1", conversation=conversation, owner="", created=0.0
    )
    echo = msgspec.to_builtins(openai_responses.skeleton(req, "resp_1", 0))
    return job, echo


def messages(**fields: Any) -> GenerateRequest:
    raw = json.dumps({"model": "m", "max_tokens": 8, "messages": [USER], **fields}).encode()
    return anthropic_messages.build_job(anthropic_messages.parse_request(raw), request_id="msg_1")


def rejected(parse: Any, **fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        parse(**fields)
    assert raised.value.http_status == 400
    return raised.value


def test_chat_response_format_and_vllm_extensions() -> None:
    named = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    assert chat(response_format=named).constraint == Constraint(
        kind="json_schema", json_schema=SCHEMA, name="thing"
    )
    assert chat(response_format={"type": "json_object"}).constraint == Constraint(
        kind="json_object"
    )
    assert chat(response_format={"type": "text"}).constraint is None
    assert chat().constraint is None
    so = {"structured_outputs": {"choice": ["a", "b"]}}
    assert chat(**so).constraint == Constraint(kind="choice", choices=["a", "b"])
    as_text = chat(structured_outputs={"json": json.dumps(SCHEMA)}).constraint
    assert as_text == Constraint(kind="json_schema", json_schema=SCHEMA)
    assert chat(guided_regex="[0-9]+").constraint == Constraint(kind="regex", regex="[0-9]+")
    lark = 'start: "x"'
    assert chat(structured_outputs={"grammar": lark}).constraint == Constraint(
        kind="grammar", grammar=lark
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "structured_outputs"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": BAD_SCHEMA, "strict": True},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_chat_rejects_what_cannot_compile(fields: dict[str, Any], param: str) -> None:
    assert rejected(chat, **fields).param == param


def test_chat_tools_keep_strict_and_unconstrained_bad_schemas_pass() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": True}}
    assert chat(tools=[tool]).tools[0].strict
    loose = {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
    assert not chat(tools=[loose]).tools[0].strict  # never constrained under auto: not checked


def test_responses_text_format_is_the_constraint_and_echoed() -> None:
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    job, echo = responses(text={"format": fmt})
    assert job.constraint == Constraint(kind="json_schema", json_schema=SCHEMA, name="thing")
    assert echo["text"]["format"] == fmt
    job, echo = responses(text={"format": {"type": "json_object"}})
    assert job.constraint == Constraint(kind="json_object")
    assert echo["text"] == {"format": {"type": "json_object"}, "verbosity": "medium"}
    job, echo = responses()
    assert job.constraint is None
    assert echo["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    tool = {"type": "function", "name": "f", "parameters": SCHEMA, "strict": True}
    assert responses(tools=[tool])[0].tools[0].strict


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        (
            {
                "tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}],
                "tool_choice": {"type": "function", "name": "f"},
            },
            "tools[0].parameters",
        ),
    ],
)
def test_responses_rejects_what_cannot_compile(fields: dict[str, Any], param: str) -> None:
    assert rejected(responses, **fields).param == param


def test_anthropic_output_format_both_spellings_and_strict_tools() -> None:
    fmt = {"type": "json_schema", "schema": SCHEMA}
    expected = Constraint(kind="json_schema", json_schema=SCHEMA)
    assert messages(output_config={"format": fmt}).constraint == expected
    assert messages(output_config={"effort": "low", "format": fmt}).constraint == expected
    assert messages(output_format=fmt).constraint == expected
    assert messages().constraint is None
    tool = {"name": "f", "input_schema": SCHEMA, "strict": True}
    assert messages(tools=[tool]).tools[0].strict


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}},
            "output_config.format.schema",
        ),
        ({"output_format": {"type": "json_schema"}}, "output_format.schema"),
        (
            {"tools": [{"name": "f", "input_schema": BAD_SCHEMA}], "tool_choice": {"type": "any"}},
            "tools[0].input_schema",
        ),
    ],
)
def test_anthropic_rejects_what_cannot_compile(fields: dict[str, Any], param: str) -> None:
    assert rejected(messages, **fields).param == param
