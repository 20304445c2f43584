"""``shared.grammar``: constraints and forced tool calls as llguidance grammars, checked up front.

Grammars are run against the tiny tokenizer with llguidance's own matcher: the text a model
would write in each tool-call syntax is accepted token by token, and what breaks it is not.
"""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from shared.errors import InvalidRequest
from shared.grammar import (
    check_constraint,
    check_schema,
    constraint_grammar,
    custom_format_constraint,
    job_grammar,
    tool_call_grammar,
    tool_markers,
)
from shared.jobs import Constraint, GenerateRequest, ToolChoice, ToolDef
from shared.model_card import ModelCard, ToolMarkers
from tests.worker_models import tiny_tokenizer

TK = tiny_tokenizer()
OPEN, CLOSE = TK.token_to_id("<tool_call>"), TK.token_to_id("</tool_call>")
LLT = LLTokenizer(TK.to_str(), eos_token=[2])
HERMES = ToolMarkers(
    style="hermes", open="<tool_call>", close="</tool_call>", open_id=OPEN, close_id=CLOSE
)
MISTRAL = ToolMarkers(style="mistral", open="<tool_call>", open_id=OPEN)  # a stand-in token
LLAMA3 = ToolMarkers(style="llama3_json")
WEATHER = ToolDef(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
TIME = ToolDef(name="get_time")


def accepts(grammar: str, ids: list[int]) -> bool:
    matcher = LLMatcher(LLT, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def ids(text: str) -> list[int]:
    return TK.encode(text, add_special_tokens=False).ids


def request(**kw: object) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("markers", "written"),
    [
        (HERMES, lambda c: [OPEN, *ids("\n" + c + "\n"), CLOSE]),
        (MISTRAL, lambda c: [OPEN, *ids("[" + c + "]")]),
        (LLAMA3, lambda c: ids(c.replace('"arguments"', '"parameters"'))),
    ],
)
def test_forced_calls_in_each_syntax(markers: ToolMarkers, written: object) -> None:
    job = request(tools=[WEATHER, TIME], tool_choice=ToolChoice(mode="required"))
    grammar = tool_call_grammar(job, markers, forced=True)
    assert grammar is not None
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert accepts(grammar, written(call))  # type: ignore[operator]
    bad = '{"name": "get_weather", "arguments": {"town": "Paris"}}'
    assert not accepts(grammar, written(bad))  # type: ignore[operator]
    unknown = '{"name": "get_mood", "arguments": {}}'
    assert not accepts(grammar, written(unknown))  # type: ignore[operator]


def test_named_choice_offers_only_that_tool() -> None:
    job = request(tools=[WEATHER, TIME], tool_choice=ToolChoice(mode="named", name="get_time"))
    grammar = tool_call_grammar(job, HERMES, forced=True)
    assert grammar is not None
    assert accepts(grammar, [OPEN, *ids('\n{"name": "get_time", "arguments": {}}\n'), CLOSE])
    call = '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    assert not accepts(grammar, [OPEN, *ids(call), CLOSE])


def test_strict_tools_under_auto_allow_text_then_valid_calls() -> None:
    strict = ToolDef(name=WEATHER.name, parameters=WEATHER.parameters, strict=True)
    job = request(tools=[strict], tool_choice=ToolChoice(mode="auto"))
    grammar = tool_call_grammar(job, HERMES, forced=False)
    assert grammar is not None
    assert accepts(grammar, ids("Just text."))
    call = '\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    assert accepts(grammar, [*ids("Let me check. "), OPEN, *ids(call), CLOSE])
    assert not accepts(grammar, [OPEN, *ids('\n{"name": "get_weather", "arguments": {}}\n')])
    assert tool_call_grammar(job, LLAMA3, forced=False) is None  # no marker tells text apart


def test_job_grammar_precedence() -> None:
    card = ModelCard(
        name="m", architecture="x", context_length=8, tokenizer_json="", chat_template=""
    )
    schema = Constraint(kind="json_object")
    forced = request(tools=[WEATHER], tool_choice=ToolChoice(mode="required"), constraint=schema)
    # no declared syntax: a forced call is a bare JSON object, which the decoder reads as a call
    assert tool_markers(None, forced) == LLAMA3
    assert job_grammar(forced, card) == tool_call_grammar(forced, LLAMA3, forced=True)
    assert job_grammar(request(constraint=schema), card) == constraint_grammar(schema)
    assert job_grammar(request(tools=[WEATHER]), card) is None
    assert tool_markers(None, request(tools=[WEATHER])) is None


def test_constraints_compile_to_what_they_promise() -> None:
    grammar = constraint_grammar(Constraint(kind="choice", choices=['say "hi"', "bye"]))
    assert accepts(grammar, ids('say "hi"')) and not accepts(grammar, ids("hi"))
    compact = constraint_grammar(Constraint(kind="json_object"))
    assert accepts(compact, ids('{"a": [1, 2]}'))
    assert not accepts(compact, ids('{\n"a": 1}'))  # no free whitespace to wander into


@pytest.mark.parametrize(
    ("constraint", "fragment"),
    [
        (Constraint(kind="choice"), "at least one"),
        (Constraint(kind="regex", regex="(ab"), "invalid regex"),
        (Constraint(kind="json_schema", json_schema={"not": {"type": "string"}}), "not"),
        (Constraint(kind="json_schema", json_schema={"type": "strnig"}), "strnig"),
        (Constraint(kind="json_schema", json_schema={"$ref": "#/nope"}), "nope"),
        (Constraint(kind="grammar", grammar="start: missing"), "missing"),
        (Constraint(kind="regex"), "needs its regex"),
    ],
)
def test_bad_constraints_name_the_parameter(constraint: Constraint, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        check_constraint(constraint, "response_format")
    assert raised.value.param == "response_format"
    assert fragment in raised.value.message


def test_tool_schemas_and_custom_formats() -> None:
    check_schema({}, "tools[0]")  # no schema: any object
    with pytest.raises(InvalidRequest) as raised:
        check_schema({"type": "object", "properties": {"a": {"type": "nope"}}}, "tools[0]")
    assert raised.value.param == "tools[0]"
    lark = custom_format_constraint("lark", 'start: "a" "b"+')
    assert lark.kind == "grammar" and accepts(constraint_grammar(lark), ids("abbb"))
    regex = custom_format_constraint("regex", r"\d{3}")
    assert regex == Constraint(kind="regex", regex=r"\d{3}")
    with pytest.raises(InvalidRequest) as raised:
        custom_format_constraint("regex", "(", "tools[1].format")
    assert raised.value.param == "tools[1].format"
    assert json.loads(json.dumps(lark.grammar)) == 'start: "a" "b"+'
