"""Golden Ollama NDJSON transcripts: byte-stable projector output per scenario, chat and generate.

Regenerate with ``SLUICE_UPDATE_GOLDEN=1 pytest tests/golden/test_ollama_golden.py`` and read the
diff like code. Each event is stamped with a synthetic entry id (1 ms apart), so ``created_at``
and the durations are part of the transcript. Every transcript is also parsed back line by line
with the official ``ollama`` client's own response models, and its concatenation must equal the
non-streaming ``render(fold(events))`` with the same timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from ollama import ChatResponse, GenerateResponse

from services.api.wire.ndjson import encode
from services.api.wire.ollama import Context, Projector, Skip, Timing, render
from services.api.wire.ollama.types import Mode
from shared.accumulate import fold
from shared.events import AnyEvent, Error
from tests.factories import SCENARIOS
from tests.golden.golden_io import assert_golden
from tests.invariants import check_stream

GOLDEN = Path(__file__).parent / "ollama"
CREATED_MS = 1_700_000_000_000
MODES: tuple[Mode, ...] = ("chat", "generate")


def _ctx(mode: Mode) -> Context:
    return Context(mode=mode, model="tiny-test", created_ms=CREATED_MS)


def _entry(i: int) -> str:
    # The worker writes its first entry 100 ms after the request was created.
    return f"{CREATED_MS + 100 + i}-0"


def transcript(projector: Projector | Skip, events: list[AnyEvent]) -> bytes:
    out = b""
    for i, event in enumerate(events):
        projector.stamp(_entry(i))
        out += b"".join(encode(frame) for frame in projector.feed(event))
    return out + b"".join(encode(frame) for frame in projector.close())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_transcript_is_byte_stable(name: str, mode: Mode) -> None:
    events = SCENARIOS[name]()
    check_stream(events)
    assert_golden(GOLDEN / f"{mode}_{name}.ndjson", transcript(Projector(_ctx(mode)), events))


def test_no_stale_transcripts() -> None:
    expected = {f"{mode}_{name}" for mode in MODES for name in SCENARIOS}
    assert {p.stem for p in GOLDEN.glob("*.ndjson")} == expected


def _concatenate(lines: list[dict[str, object]], mode: Mode) -> dict[str, object]:
    """What a client builds from a stream: the fragments joined, the last line's metrics."""
    final = dict(lines[-1])
    if mode == "generate":
        GenerateResponse.model_validate(final)
        for field in ("response", "thinking"):
            joined = "".join(str(line.get(field) or "") for line in lines)
            final[field] = joined if joined or field == "response" else None
        return {k: v for k, v in final.items() if v is not None}
    parts = [ChatResponse.model_validate(line).message for line in lines]
    content = "".join(p.content or "" for p in parts)
    message: dict[str, object] = {"role": "assistant", "content": content}
    if thinking := "".join(p.thinking or "" for p in parts):
        message["thinking"] = thinking
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]  # type: ignore[attr-defined]
    if calls:
        message["tool_calls"] = calls
    return {**final, "message": message}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_stream_concatenates_to_render(name: str, mode: Mode) -> None:
    events = SCENARIOS[name]()
    raw = (GOLDEN / f"{mode}_{name}.ndjson").read_bytes()
    lines = [json.loads(line) for line in raw.splitlines()]
    assert raw.endswith(b"\n") and all(lines)
    if isinstance(events[-1], Error):
        assert lines[-1] == {"error": events[-1].message}
        assert not any(line.get("done") for line in lines)
        return
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    timing = Timing(start_ms=CREATED_MS + 100, end_ms=int(_entry(len(events) - 1)[:-2]))
    body = msgspec.to_builtins(render(fold(events), _ctx(mode), timing))
    assert _concatenate(lines, mode) == body


@pytest.mark.parametrize("skip", [0, 1, 2, 5])
def test_skip_resumes_after_the_lines_a_client_has(skip: int) -> None:
    events = SCENARIOS["reasoning_tool_call"]()
    whole = transcript(Projector(_ctx("chat")), events).splitlines(keepends=True)
    resumed = transcript(Skip(Projector(_ctx("chat")), skip), events)
    assert resumed == b"".join(whole[skip:])


def test_hidden_thinking_is_dropped() -> None:
    ctx = Context(mode="chat", model="tiny-test", created_ms=CREATED_MS, show_thinking=False)
    raw = transcript(Projector(ctx), SCENARIOS["reasoning"]())
    assert b"thinking" not in raw
    body = msgspec.to_builtins(render(fold(SCENARIOS["reasoning"]()), ctx, Timing()))
    assert "thinking" not in body["message"]
