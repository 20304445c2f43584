"""Byte-stable Chat Completions SSE transcripts for every factory scenario.

Regenerate with ``SLUICE_UPDATE_GOLDEN=1``; review the diff like code. The transcripts are also
what the conformance tests feed the openai SDK.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.wire.openai_chat import Context as ChatContext, Projector as ChatProjector
from shared.events import AnyEvent, ReasoningDelta
from tests.factories import SCENARIOS
from tests.golden.golden_io import assert_golden, project
from tests.invariants import check_stream

GOLDEN_DIR = Path(__file__).parent / "openai_chat"
CHAT_ID = "chatcmpl-0000000000000001"
CREATED = 1_700_000_000
MODEL = "tiny-test"


def golden_cases() -> list[tuple[str, str, bool, bool]]:
    """(file stem, scenario, include_usage, include_reasoning) for every transcript."""
    cases = []
    for name, factory in SCENARIOS.items():
        has_reasoning = any(isinstance(e, ReasoningDelta) for e in factory())
        for usage in (False, True):
            for shown in (False, True) if has_reasoning else (False,):
                stem = name + (".usage" if usage else "") + (".reasoning" if shown else "")
                cases.append((stem, name, usage, shown))
    return cases


def context(*, include_usage: bool, include_reasoning: bool) -> ChatContext:
    """The deterministic context every golden transcript is rendered with."""
    return ChatContext(
        id=CHAT_ID,
        created=CREATED,
        model=MODEL,
        include_usage=include_usage,
        include_reasoning=include_reasoning,
    )


def transcript(events: list[AnyEvent], ctx: ChatContext) -> bytes:
    """Project events into the SSE bytes a client receives."""
    return project(ChatProjector(ctx), events)


@pytest.mark.parametrize(
    ("stem", "scenario", "usage", "shown"), golden_cases(), ids=[c[0] for c in golden_cases()]
)
def test_transcript_matches_golden(stem: str, scenario: str, usage: bool, shown: bool) -> None:
    events = SCENARIOS[scenario]()
    check_stream(events)
    actual = transcript(events, context(include_usage=usage, include_reasoning=shown))
    assert_golden(GOLDEN_DIR / f"{stem}.sse", actual)


def test_every_golden_file_has_a_case() -> None:
    stems = {c[0] for c in golden_cases()}
    stale = {p.stem for p in GOLDEN_DIR.glob("*.sse")} - stems
    assert not stale, f"golden files without a scenario: {sorted(stale)}"
