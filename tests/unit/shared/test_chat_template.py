"""Chat templates render byte-identically to transformers, inside a real sandbox.

``tests/fixtures/templates/expected.json`` was recorded with ``transformers.apply_chat_template``
by ``tests/fixtures/templates/record.py`` (transformers is not a project dependency).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from shared.chat_template import TemplateError, render_chat_template, template_mentions

TEMPLATES = pathlib.Path(__file__).parents[2] / "fixtures" / "templates"
RECORDED = json.loads((TEMPLATES / "expected.json").read_text())["cases"]


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize("case", RECORDED, ids=[c["name"] for c in RECORDED])
def test_render_matches_transformers(case: dict[str, Any]) -> None:
    text = render_chat_template(
        template(case["template"]),
        case["messages"],
        tools=case.get("tools"),
        add_generation_prompt=case["agp"],
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        **case.get("kwargs", {}),
    )
    assert text == case["expected"]


def test_recorded_cases_cover_every_supported_template() -> None:
    assert {c["template"] for c in RECORDED} == {
        "smollm2",
        "qwen2.5",
        "qwen3",
        "llama3.1",
        "mistral",
    }


def test_tojson_keeps_order_unicode_and_markup() -> None:
    out = render_chat_template(
        "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}"
        "|{{ tools | tojson(separators=(',', ':')) }}",
        [],
        tools=[{"z": "<b>é</b>", "a": [1, 2]}],
    )
    compact, indented, tight = out.split("|")
    assert compact == '[{"z": "<b>é</b>", "a": [1, 2]}]'
    assert indented == '{\n  "z": "<b>é</b>",\n  "a": [\n    1,\n    2\n  ]\n}'
    assert tight == '[{"z":"<b>é</b>","a":[1,2]}]'


def test_raise_exception_becomes_template_error() -> None:
    with pytest.raises(TemplateError, match="no system"):
        render_chat_template("{{ raise_exception('no system') }}", [])


def test_sandbox_blocks_attribute_escapes() -> None:
    with pytest.raises(TemplateError):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(TemplateError):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])


def test_immutable_sandbox_refuses_mutation() -> None:
    with pytest.raises(TemplateError):
        render_chat_template("{% set x = [] %}{{ x.append(1) }}", [])


def test_kwargs_loopcontrols_generation_and_trim_blocks() -> None:
    source = (
        "{% for m in messages %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% generation %}[{{ m.content }}]{% endgeneration %}\n"
        "{% endfor %}{{ custom_flag }}|{{ strftime_now('%Y') | length }}"
    )
    msgs = [{"role": "user", "content": str(i)} for i in range(4)]
    assert render_chat_template(source, msgs, custom_flag="yes") == "[0][1]yes|4"


def test_none_valued_keys_are_dropped_and_reasoning_aliased() -> None:
    source = (
        "{% for m in messages %}{{ m.name is defined }}"
        "{{ m.thinking }}/{{ m.reasoning_content }}{% endfor %}"
    )
    msgs = [{"role": "assistant", "content": "x", "name": None, "reasoning_content": "r"}]
    assert render_chat_template(source, msgs) == "Falser/r"


def test_bad_syntax_is_a_template_error() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])


def test_template_mentions_reads_variables_not_text() -> None:
    assert template_mentions(template("qwen3"), "enable_thinking")
    assert not template_mentions(template("qwen2.5"), "enable_thinking")
    assert not template_mentions("{{ 'enable_thinking' }}", "enable_thinking")
