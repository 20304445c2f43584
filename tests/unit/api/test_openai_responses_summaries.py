"""Reasoning summaries: requested with ``reasoning.summary``, streamed and folded alike.

The summary is the raw reasoning verbatim (sluice has no second model to summarize with), one
``summary_text`` part per reasoning item, next to the ``reasoning_text`` content; every event
must parse as the official SDK's own ``ResponseStreamEvent``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from openai.types.responses import Response as SdkResponse, ResponseStreamEvent
from pydantic import TypeAdapter

from services.api.wire.openai_responses import Context, Projector, parse_request, render, skeleton
from shared.accumulate import fold
from tests.factories import SCENARIOS

RID = "resp_0000000000000000000000aa"
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _skeleton(summary: str | None) -> Any:
    body: dict[str, Any] = {"model": "m", "input": "x"}
    if summary is not None:
        body["reasoning"] = {"summary": summary}
    return skeleton(parse_request(json.dumps(body).encode()), RID, 1)


def _stream(summary: str | None, scenario: str) -> list[dict[str, Any]]:
    projector = Projector(Context(skeleton=_skeleton(summary)))
    events = SCENARIOS[scenario]()
    frames = [f for e in events for f in projector.feed(e)] + projector.close()
    out = [json.loads(f.data) for f in frames]
    for event in out:
        STREAM_EVENT.validate_python(event)
    return out


@pytest.mark.parametrize("summary", ["auto", "concise", "detailed"])
def test_summary_parts_stream_next_to_the_raw_reasoning(summary: str) -> None:
    out = _stream(summary, "reasoning")
    reasoning = fold(SCENARIOS["reasoning"]()).reasoning
    kinds = [e["type"] for e in out]
    added = kinds.index("response.reasoning_summary_part.added")
    assert kinds[added - 1] == "response.output_item.added"
    deltas = [e["delta"] for e in out if e["type"] == "response.reasoning_summary_text.delta"]
    raw = [e["delta"] for e in out if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "".join(raw) == reasoning
    (done,) = [e for e in out if e["type"] == "response.reasoning_summary_text.done"]
    (part,) = [e for e in out if e["type"] == "response.reasoning_summary_part.done"]
    assert done["text"] == part["part"]["text"] == reasoning
    assert kinds.index("response.reasoning_summary_part.done") < kinds.index(
        "response.output_item.done"
    )
    item = next(e["item"] for e in out if e["type"] == "response.output_item.done")
    assert item["summary"] == [{"type": "summary_text", "text": reasoning}]
    assert item["content"] == [{"type": "reasoning_text", "text": reasoning}]
    folded = json.loads(
        msgspec.json.encode(render(fold(SCENARIOS["reasoning"]()), _skeleton(summary)))
    )
    assert out[-1]["response"] == folded
    SdkResponse.model_validate(folded)


def test_no_summary_unless_asked() -> None:
    out = _stream(None, "reasoning_tool_call")
    assert not any("summary" in e["type"] for e in out)
    items = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert all(i["summary"] == [] for i in items if i["type"] == "reasoning")
