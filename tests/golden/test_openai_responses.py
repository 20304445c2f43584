"""Byte-stable Responses SSE transcripts for every factory scenario.

Regenerate with ``SLUICE_UPDATE_GOLDEN=1``; review the diff like code. The transcripts are also
what the conformance tests feed the openai SDK (``tests/conformance/test_openai_responses_sdk.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.api.wire.openai_responses import (
    Context as ResponsesContext,
    Projector as ResponsesProjector,
    Response,
    parse_request,
    skeleton,
)
from shared.events import AnyEvent
from tests.factories import SCENARIOS
from tests.golden.golden_io import assert_golden, project
from tests.invariants import check_stream

GOLDEN_DIR = Path(__file__).parent / "openai_responses"
RESPONSE_ID = "resp_0000000000000001"
CREATED = 1_700_000_000
REQUEST = {
    "model": "tiny-test",
    "input": "What is the weather in Paris and Oslo?",
    "tools": [
        {
            "type": "function",
            "name": name,
            "description": f"{name} for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": False,
        }
        for name in ("get_weather", "get_time")
    ],
}


def golden_skeleton() -> Response:
    """The deterministic request echo every golden transcript is rendered with."""
    return skeleton(parse_request(json.dumps(REQUEST).encode()), RESPONSE_ID, CREATED)


def transcript(events: list[AnyEvent], starting_after: int = -1) -> bytes:
    """Project events into the SSE bytes a client receives."""
    ctx = ResponsesContext(skeleton=golden_skeleton(), starting_after=starting_after)
    return project(ResponsesProjector(ctx), events)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_transcript_matches_golden(scenario: str) -> None:
    events = SCENARIOS[scenario]()
    check_stream(events)
    actual = transcript(events)
    assert_golden(GOLDEN_DIR / f"{scenario}.sse", actual)


def test_every_golden_file_has_a_scenario() -> None:
    stale = {p.stem for p in GOLDEN_DIR.glob("*.sse")} - set(SCENARIOS)
    assert not stale, f"golden files without a scenario: {sorted(stale)}"
