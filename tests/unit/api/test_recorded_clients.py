"""The request bodies Codex CLI and Claude Code really send, replayed through the API's parsers.

The fixtures in ``tests/fixtures/clients`` were captured once from the pinned programs
(``tests/conformance/real_clients.py``) with a recording server; each is parsed by its wire
format, turned into a job and rendered through a real chat template (the scripted backend's,
which renders tools), exactly as admission does before anything is enqueued.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.api.wire import anthropic_messages, openai_responses
from services.worker.scripted import ScriptedBackend
from shared.jobs import GenerateRequest
from shared.prompt import PromptRenderer

FIXTURES = Path(__file__).parents[2] / "fixtures" / "clients"
CODEX = sorted(FIXTURES.glob("codex-*.json"))
CLAUDE = sorted(FIXTURES.glob("claude-code-*.json"))
RENDERER = PromptRenderer(ScriptedBackend(name="recorded", context=200_000).card)


def _load(path: Path) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(path.read_text())
    return body


def _prompt(job: GenerateRequest) -> str:
    return RENDERER.render(job).text


def test_fixtures_are_there() -> None:
    assert len(CODEX) >= 2 and len(CLAUDE) >= 2


@pytest.mark.parametrize("path", CODEX, ids=lambda p: p.name)
def test_codex_request_renders_every_tool_it_declares(path: Path) -> None:
    body = _load(path)
    req = openai_responses.parse_request(json.dumps(body).encode())
    conv = openai_responses.input_messages(req)
    job = openai_responses.build_job(
        req, request_id="resp_x", conversation=conv, owner="", created=0
    )
    prompt = _prompt(job)
    declared = openai_responses.tool_set(req)
    for tool in declared.defs:
        assert f'"name": "{tool.name}"' in prompt
    assert declared.ignored == ["web_search"]
    assert job.messages[-1].text == "say hi"
    # Codex sends its developer instructions as input messages and store: false.
    assert body["store"] is False and job.messages[0].role == "system"


@pytest.mark.parametrize("path", CLAUDE, ids=lambda p: p.name)
def test_claude_code_request_renders_with_its_defaults(path: Path) -> None:
    body = _load(path)
    assert body["max_tokens"] == 32000  # what admission must answer in Anthropic's words
    req = anthropic_messages.parse_request(json.dumps(body).encode())
    job = anthropic_messages.build_job(req, request_id="msg_x")
    assert job.max_tokens == 32000
    prompt = _prompt(job)
    assert [t.name for t in job.tools] == [t["name"] for t in body["tools"]]
    assert all(f'"name": "{t["name"]}"' in prompt for t in body["tools"])
    # Claude Code puts a role "system" turn after the user's (its reminders); both are kept.
    assert [m.role for m in job.messages][-2:] == ["user", "system"]
    assert job.messages[-2].text.endswith("say hi")


def test_claude_code_thinking_display_updates_is_accepted_and_named() -> None:
    # Claude Code 2.1.332 sends display "updates"; sluice answered 400 `Invalid enum value`.
    raw = (FIXTURES / "claude-code-2.1.332-messages-thinking-updates.json").read_bytes()
    req = anthropic_messages.parse_request(raw)
    assert req.thinking is not None and req.thinking.display == "updates"
    job = anthropic_messages.build_job(req, request_id="msg_x")
    assert job.reasoning.visible and job.reasoning.budget_tokens == 31999
    fields = anthropic_messages.ignored_fields(raw, req)
    assert fields == ["context_management", "thinking.display"]
