"""A final assistant turn continued as the answer: Anthropic's prefill, vLLM's
``continue_final_message`` on Chat. The rules the formats set are checked before anything is
enqueued; the rendering is ``tests/unit/shared/test_prompt_prefill.py``'s."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.api.wire.anthropic_messages import build_job, parse_request
from services.api.wire.ollama.request import parse_chat as parse_ollama_chat
from services.api.wire.openai_chat.request import parse_request as parse_chat
from shared.errors import InvalidRequest

ASK = {"role": "user", "content": "Capital of France?"}


def anthropic(*turns: dict[str, Any], **fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 8, "messages": list(turns), **fields}).encode()


def continued(raw: bytes) -> bool:
    return build_job(parse_request(raw), request_id="msg_1").continue_final


def test_a_final_assistant_turn_is_continued() -> None:
    assert continued(anthropic(ASK, {"role": "assistant", "content": "The capital is"}))
    blocks = [{"type": "text", "text": "{"}, {"type": "text", "text": '"city":'}]
    assert continued(anthropic(ASK, {"role": "assistant", "content": blocks}))
    assert not continued(anthropic(ASK))
    answered = [ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "?"}]
    assert not continued(anthropic(*answered))


@pytest.mark.parametrize("empty", ["", []])
def test_an_empty_final_assistant_turn_is_no_prefill(empty: object) -> None:
    assert not continued(anthropic(ASK, {"role": "assistant", "content": empty}))


def test_a_prefill_ending_in_whitespace_is_refused_as_anthropic_refuses_it() -> None:
    with pytest.raises(InvalidRequest, match="cannot end with trailing whitespace") as raised:
        continued(anthropic(ASK, {"role": "assistant", "content": "The capital is "}))
    assert raised.value.param == "messages[1].content"


def test_a_prefill_with_thinking_on_is_refused() -> None:
    prefill = {"role": "assistant", "content": "Well"}
    with pytest.raises(InvalidRequest, match="thinking"):
        continued(anthropic(ASK, prefill, thinking={"type": "enabled", "budget_tokens": 64}))
    assert continued(anthropic(ASK, prefill, thinking={"type": "disabled"}))


def test_a_tool_call_cannot_be_continued() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    with pytest.raises(InvalidRequest, match="text blocks only, not 'tool_use'") as raised:
        continued(anthropic(ASK, {"role": "assistant", "content": [call]}))
    assert raised.value.param == "messages[1].content[0]"


def chat(*messages: dict[str, Any], **fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages), **fields}).encode()


def test_chat_continues_the_final_message_only_when_asked() -> None:
    turns = [ASK, {"role": "assistant", "content": "The capital is"}]
    asked = parse_chat(chat(*turns, continue_final_message=True), request_id="c")
    assert asked.job.continue_final and asked.ignored_fields == []
    # as vLLM's clients send it; the field reaches the template as chat_template_kwargs' would
    vllm = parse_chat(
        chat(*turns, continue_final_message=True, add_generation_prompt=False), request_id="c"
    )
    assert vllm.job.continue_final and vllm.ignored_fields == []
    assert vllm.job.chat_template_kwargs == {"add_generation_prompt": False}
    assert not parse_chat(chat(*turns), request_id="c").job.continue_final


def test_chat_refuses_to_continue_a_user_message_or_a_tool_call() -> None:
    with pytest.raises(InvalidRequest, match="last message to be the assistant's"):
        parse_chat(chat(ASK, continue_final_message=True), request_id="c")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = {"role": "assistant", "content": None, "tool_calls": [call]}
    with pytest.raises(InvalidRequest, match="no tool_calls"):
        parse_chat(chat(ASK, called, continue_final_message=True), request_id="c")


def test_ollama_continues_a_final_assistant_message_as_its_templates_do() -> None:
    def ollama(*messages: dict[str, Any]) -> bool:
        return parse_ollama_chat(chat(*messages), request_id="o").job.continue_final

    assert ollama(ASK, {"role": "assistant", "content": "The capital is"})
    assert not ollama(ASK)
    assert not ollama(ASK, {"role": "assistant", "content": ""})
    call = {"function": {"name": "f", "arguments": {}}}
    assert not ollama(ASK, {"role": "assistant", "content": "", "tool_calls": [call]})
