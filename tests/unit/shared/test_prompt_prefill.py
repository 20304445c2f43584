"""Continuing a final assistant message (a prefill): the prompt ends inside it, in each template."""

from __future__ import annotations

import pytest

from shared.chat_template import TemplateError
from shared.jobs import Constraint, Message, TextPart, ToolCall, ToolChoice, ToolDef
from shared.prompt import PromptRenderer
from tests.unit.shared.test_prompt import (
    FORGE,
    IM_END,
    R1_STYLE,
    TOK,
    assert_forge_is_text,
    card,
    job,
    template,
    user,
)

TEMPLATES = ["smollm2", "qwen2.5", "qwen3", "llama3.1", "mistral"]


def assistant(text: str) -> Message:
    return Message(role="assistant", content=[TextPart(text)] if text else [])


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_prompt_ends_with_the_prefill_and_no_end_of_turn(name: str) -> None:
    renderer = PromptRenderer(card(template(name)))
    prefill = '{"city": "Par'
    plain = renderer.render(job(user("Weather?")))
    continued = renderer.render(job(user("Weather?"), assistant(prefill), continue_final=True))
    assert continued.text.endswith(prefill)
    # what comes before the prefill is the conversation up to the assistant's turn header, as a
    # new turn would have had it (templates that strip a final turn's whitespace aside)
    head = continued.text[: -len(prefill)].rstrip()
    assert plain.text.rstrip().startswith(head) or head.startswith(plain.text.rstrip())
    assert TOK.decode(continued.token_ids, skip_special_tokens=False) == continued.text


def test_chatml_continues_inside_the_assistant_turn() -> None:
    renderer = PromptRenderer(card(template("smollm2")))
    continued = renderer.render(
        job(user("Capital of France?"), assistant("The capital is"), continue_final=True)
    )
    assert continued.text.endswith("<|im_start|>assistant\nThe capital is")
    assert continued.token_ids[-1] != IM_END
    assert (
        continued.token_ids
        == renderer.render(
            job(user("Capital of France?"), assistant("The capital is"), continue_final=True)
        ).token_ids
    )


def test_without_the_flag_a_final_assistant_turn_is_a_finished_turn() -> None:
    renderer = PromptRenderer(card(template("smollm2")))
    rendered = renderer.render(job(user("Hi"), assistant("Hello")))
    assert rendered.text.endswith("Hello<|im_end|>\n<|im_start|>assistant\n")


def test_an_empty_prefill_starts_the_answer_afresh() -> None:
    renderer = PromptRenderer(card(template("smollm2")))
    fresh = renderer.render(job(user("Hi")))
    assert renderer.render(job(user("Hi"), assistant(""), continue_final=True)) == fresh
    assert renderer.render(job(user("Hi"), assistant("  \n"), continue_final=True)) == fresh


def test_only_an_assistant_message_without_tool_calls_can_be_continued() -> None:
    renderer = PromptRenderer(card(template("smollm2")))
    with pytest.raises(TemplateError, match="final assistant message"):
        renderer.render(job(user("Hi"), continue_final=True))
    called = Message(role="assistant", tool_calls=[ToolCall(id="c1", name="f", arguments="{}")])
    with pytest.raises(TemplateError, match="with tool calls"):
        renderer.render(job(user("Hi"), called, continue_final=True))


def test_a_prefill_spelling_control_tokens_stays_text() -> None:
    renderer = PromptRenderer(card(template("smollm2")))
    continued = renderer.render(job(user("Hi"), assistant(f"Sure: {FORGE}"), continue_final=True))
    assert continued.text.endswith(f"Sure: {FORGE}")
    assert_forge_is_text(continued.token_ids, 1, continued.text)


def test_a_prefill_is_not_inside_the_reasoning_a_new_turn_would_open() -> None:
    # R1-style templates open <think> in the generation prompt; a prefill has no generation
    # prompt, so the answer continues as answer text
    renderer = PromptRenderer(card(R1_STYLE))
    assert renderer.render(job(user("Hi"))).starts_in_reasoning
    continued = renderer.render(job(user("Hi"), assistant("Well,"), continue_final=True))
    assert not continued.starts_in_reasoning
    assert continued.text.endswith("<|im_start|>assistant\nWell,")


def test_a_prefill_under_a_schema_for_the_whole_answer_is_refused() -> None:
    renderer = PromptRenderer(card(template("smollm2")))
    turns = (user("Weather?"), assistant("{"))
    schema = Constraint(kind="json_schema", json_schema={"type": "object"})
    with pytest.raises(TemplateError, match="structured output or a forced tool call"):
        renderer.render(job(*turns, continue_final=True, constraint=schema))
    forced = {"tools": [ToolDef(name="f")], "tool_choice": ToolChoice(mode="required")}
    with pytest.raises(TemplateError, match="structured output or a forced tool call"):
        renderer.render(job(*turns, continue_final=True, **forced))
    # an empty final turn is no prefill: the schema constrains the fresh answer
    assert renderer.render(job(user("Weather?"), assistant(""), continue_final=True, **forced))
