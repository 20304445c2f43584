"""Golden Anthropic Messages SSE transcripts: byte-stable projector output per scenario.

Regenerate with ``SLUICE_UPDATE_GOLDEN=1 pytest tests/golden/test_anthropic_golden.py`` and read
the diff like code. Each transcript is also replayed through the strict consumer, and the
message it builds must equal the non-streaming ``render(fold(events))``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.api.wire.anthropic_messages import (
    Context as MessageContext,
    Projector as AnthropicProjector,
    render,
)
from shared.accumulate import fold
from shared.events import AnyEvent, Error
from tests.factories import SCENARIOS
from tests.golden.anthropic_messages.consumer import StreamFailed, parse_sse, strict_consume
from tests.golden.golden_io import assert_golden, project
from tests.invariants import check_stream

GOLDEN = Path(__file__).parent / "anthropic_messages"
CTX = MessageContext(message_id="msg_0000000000000001", model="tiny-test")


def transcript(events: list[AnyEvent]) -> bytes:
    return project(AnthropicProjector(CTX), events)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_transcript_is_byte_stable(name: str) -> None:
    events = SCENARIOS[name]()
    check_stream(events)
    raw = transcript(events)
    assert_golden(GOLDEN / f"{name}.sse", raw)


def test_no_stale_transcripts() -> None:
    assert {p.stem for p in GOLDEN.glob("*.sse")} == set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_transcript_passes_strict_consumer_and_equals_render(name: str) -> None:
    events = SCENARIOS[name]()
    check_stream(events)
    parsed = parse_sse((GOLDEN / f"{name}.sse").read_bytes())
    last = events[-1]
    if isinstance(last, Error):
        with pytest.raises(StreamFailed) as failed:
            strict_consume(parsed)
        assert failed.value.error["message"] == last.message
        expected = "invalid_request_error" if last.kind == "cancelled" else None
        assert failed.value.error["type"] in {"api_error", "overloaded_error", expected}
        return
    assert strict_consume(parsed) == msgspec.to_builtins(render(fold(events), CTX))
