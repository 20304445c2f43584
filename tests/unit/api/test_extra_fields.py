"""Request fields the newest SDKs send: accepted and named, or refused with a clear 400.

The three request types were audited against the installed ``anthropic`` and ``openai`` SDKs'
request params; a field that only affects billing, caching or routing is accepted and named in
``x-sluice-ignored-fields``, one that would change the answer in a way sluice cannot honour
(or a ``priority`` / ``timeout`` it would silently not keep) is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.api.wire import anthropic_messages, openai_chat, openai_responses
from shared.errors import InvalidRequest

_MESSAGES: dict[str, Any] = {
    "model": "m",
    "max_tokens": 2048,
    "messages": [{"role": "user", "content": "hi"}],
}
_CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
_RESPONSES: dict[str, Any] = {"model": "m", "input": "hi"}


def _b(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _messages(**extra: Any) -> tuple[bytes, anthropic_messages.MessagesRequest]:
    raw = _b({**_MESSAGES, **extra})
    return raw, anthropic_messages.parse_request(raw)


@pytest.mark.parametrize("thinking_type", ["enabled", "adaptive"])
def test_anthropic_thinking_display_updates_is_shown_as_summarized(thinking_type: str) -> None:
    thinking: dict[str, object] = {"type": thinking_type, "display": "updates"}
    if thinking_type == "enabled":
        thinking["budget_tokens"] = 1024
    raw, req = _messages(thinking=thinking)
    assert anthropic_messages.build_job(req, request_id="msg_x").reasoning.visible
    assert anthropic_messages.ignored_fields(raw, req) == ["thinking.display"]


def test_anthropic_thinking_between_tools_is_thinking_off() -> None:
    raw, req = _messages(thinking={"type": "between_tools"})
    assert anthropic_messages.build_job(req, request_id="msg_x").reasoning.effort == "none"
    assert anthropic_messages.ignored_fields(raw, req) == []


def test_anthropic_newest_sdk_fields_are_accepted_and_named() -> None:
    raw, req = _messages(
        context_management={"edits": []},
        service_tier="auto",
        inference_geo="us",
        speed="fast",
        container=None,  # null means "the default": not named
        thinking={"type": "adaptive", "display": "summarized", "block_binding": {}},
    )
    fields = anthropic_messages.ignored_fields(raw, req)
    assert fields == ["context_management", "service_tier", "inference_geo", "speed"]


@pytest.mark.parametrize(("field", "value"), [("priority", 5), ("timeout", 30), ("priority", -1)])
def test_priority_and_timeout_are_refused_in_every_format(field: str, value: int) -> None:
    for parse in (
        lambda: anthropic_messages.parse_request(_b({**_MESSAGES, field: value})),
        lambda: openai_chat.parse_request(_b({**_CHAT, field: value}), request_id="c"),
        lambda: openai_responses.parse_request(_b({**_RESPONSES, field: value})),
    ):
        with pytest.raises(InvalidRequest) as err:
            parse()
        assert err.value.param == field and "not supported" in str(err.value)


def test_null_priority_is_the_default() -> None:
    parsed = openai_chat.parse_request(_b({**_CHAT, "priority": None}), request_id="c")
    assert parsed.ignored_fields == []


def test_chat_newest_sdk_fields_are_accepted_and_named() -> None:
    body = {
        **_CHAT,
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "prompt_cache_options": {"ttl": "24h"},
        "safety_identifier": "s",
        "verbosity": "low",
        "prediction": {"type": "content", "content": "x"},
        "web_search_options": {},
        "modalities": ["text"],
    }
    parsed = openai_chat.parse_request(_b(body), request_id="c")
    assert parsed.ignored_fields == [
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_options",
        "safety_identifier",
        "verbosity",
        "prediction",
        "web_search_options",
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
    ],
)
def test_chat_refuses_what_would_change_the_answer(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        openai_chat.parse_request(_b({**_CHAT, field: value}), request_id="c")
    assert err.value.param == field


def test_responses_newest_sdk_fields_are_accepted_and_named() -> None:
    body = {
        **_RESPONSES,
        "prompt_cache_key": "k",
        "service_tier": "flex",
        "moderation": {"enabled": True},
        "prompt_cache_options": {"ttl": "24h"},
        "context_management": [{"type": "compaction"}],
        "stream_options": {"include_obfuscation": False},
    }
    raw = _b(body)
    req = openai_responses.parse_request(raw)
    assert openai_responses.ignored_fields(raw, req) == [
        "prompt_cache_key",
        "service_tier",
        "moderation",
        "prompt_cache_options",
        "context_management",
        "stream_options",
    ]


def test_responses_refuses_a_stored_prompt() -> None:
    body = {**_RESPONSES, "prompt": {"id": "pmpt_1", "variables": {}}}
    with pytest.raises(InvalidRequest) as err:
        openai_responses.parse_request(_b(body))
    assert err.value.param == "prompt"
