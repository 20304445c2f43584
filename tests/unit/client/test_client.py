"""The event client's offline sources: scripted scenarios and JSONL recordings."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shared.errors import ProtocolError
from sluice_client import LiveSource, RecordedSource, ScriptedSource, StreamEvent, read_all
from tests.factories import SCENARIOS
from tests.invariants import check_stream


@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_scripted_source_yields_the_script(name: str) -> None:
    events = SCENARIOS[name]()
    got = await read_all(ScriptedSource(events))
    check_stream(got)
    assert got == events


async def test_scripted_source_spacing_in_t_ms() -> None:
    items = [i async for i in ScriptedSource(SCENARIOS["text"](), delay_s=0.001).events()]
    assert [i.t_ms for i in items] == pytest.approx([n * 1.0 for n in range(len(items))])


def write_recording(path: Path, name: str) -> list[StreamEvent]:
    items = [
        StreamEvent(id=f"1700000000{n:03d}-0", t_ms=float(n), event=e)
        for n, e in enumerate(SCENARIOS[name]())
    ]
    path.write_bytes(b"\n".join(msgspec.json.encode(i) for i in items) + b"\n")
    return items


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("realtime", [False, True])
async def test_recorded_source_round_trips(tmp_path: Path, name: str, realtime: bool) -> None:
    path = tmp_path / f"{name}.jsonl"
    items = write_recording(path, name)
    got = [i async for i in RecordedSource(path, realtime=realtime).events()]
    assert got == items
    check_stream([i.event for i in got])


async def test_recording_line_format_is_plain_json(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_recording(path, "tool_call")
    first = msgspec.json.decode(path.read_bytes().splitlines()[0])
    assert first == {
        "id": "1700000000000-0",
        "t_ms": 0.0,
        "event": {
            "type": "start",
            "request_id": "req_0000000000000001",
            "model": "tiny-test",
            "prompt_tokens": 12,
            "cached_tokens": 4,
            "attempt": 1,
        },
    }


async def test_recorded_source_rejects_garbage(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "1-0", "t_ms": 0, "event": {"type": "nope"}}\n')
    with pytest.raises(ProtocolError, match=r"bad\.jsonl:1"):
        await read_all(RecordedSource(path))


def test_live_source_needs_exactly_one_of_job_and_id() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        LiveSource("http://x")
    with pytest.raises(ValueError, match="exactly one"):
        LiveSource("http://x", job={"model": "m"}, request_id="req_1")
