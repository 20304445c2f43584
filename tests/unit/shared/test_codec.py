"""Codec: round trip for every event type (property-based) and pinned bytes per event type."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import get_args

import msgspec
import pytest
from hypothesis import given, strategies as st

from shared import codec
from shared.errors import ProtocolError
from shared.events import (
    AnyEvent,
    Error,
    ErrorKind,
    Finish,
    FinishReason,
    ReasoningDelta,
    ReasoningEnd,
    Start,
    TextDelta,
    TokenLogprob,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    TopLogprob,
    Usage,
)
from shared.jobs import GenerateRequest, Job, Message, ReasoningControl, TextPart, ToolCall, ToolDef

FIXTURE = Path(__file__).parent.parent.parent / "fixtures" / "event_bytes.json"

texts = st.text(max_size=40)
ids = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=8)
small = st.integers(min_value=0, max_value=10**9)
logprobs = st.builds(
    TokenLogprob,
    token=texts,
    logprob=st.floats(allow_nan=False, max_value=0),
    top=st.lists(
        st.builds(TopLogprob, token=texts, logprob=st.floats(allow_nan=False, max_value=0)),
        max_size=3,
    ),
)

EVENTS = st.one_of(
    st.builds(Start, request_id=texts, model=texts, prompt_tokens=small, cached_tokens=small),
    st.builds(TextDelta, text=texts, token_ids=ids, logprobs=st.none() | st.lists(logprobs)),
    st.builds(ReasoningDelta, text=texts, token_ids=ids),
    st.builds(ReasoningEnd, signature=st.none() | texts, token_ids=ids),
    st.builds(ToolCallStart, index=small, call_id=texts, name=texts, token_ids=ids),
    st.builds(ToolCallArgsDelta, index=small, fragment=texts, token_ids=ids),
    st.builds(ToolCallEnd, index=small, arguments=texts, token_ids=ids),
    st.builds(Usage, input_tokens=small, output_tokens=small, cached_tokens=small),
    st.builds(
        Finish,
        reason=st.sampled_from(get_args(FinishReason)),
        stop_sequence=st.none() | texts,
        token_ids=ids,
    ),
    st.builds(
        Error,
        kind=st.sampled_from(get_args(ErrorKind)),
        message=texts,
        retryable=st.booleans(),
    ),
)


@given(EVENTS)
def test_every_event_round_trips_through_the_envelope(event: AnyEvent) -> None:
    assert codec.decode_entry(codec.encode_entry(event)) == [event]
    assert codec.decode_event(codec.encode_event(event)) == event


@given(st.lists(EVENTS, min_size=1, max_size=6))
def test_a_steps_events_round_trip_as_one_entry(events: list[AnyEvent]) -> None:
    fields = codec.encode_entry(events)
    assert fields[b"v"] == b"2"
    assert codec.decode_entry(fields) == events


def test_version_1_entries_of_older_workers_still_decode() -> None:
    # Logs written before entries held lists live for the retention: one event per entry.
    for event in PINNED.values():
        assert codec.decode_entry({b"v": b"1", b"e": codec.encode_event(event)}) == [event]


def test_an_entry_without_events_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="without events"):
        codec.decode_entry({b"v": b"2", b"e": codec.encode_events([])})
    with pytest.raises(ProtocolError, match="undecodable"):
        codec.decode_entry({b"v": b"2", b"e": codec.encode_event(PINNED["usage"])})


PINNED: dict[str, AnyEvent] = {
    "start": Start(request_id="req_1", model="m", prompt_tokens=3, cached_tokens=1),
    "text": TextDelta(text="hé", token_ids=[5], logprobs=[TokenLogprob(token="hé", logprob=-0.5)]),
    "reasoning": ReasoningDelta(text="hmm", token_ids=[6]),
    "reasoning_end": ReasoningEnd(signature="sig", token_ids=[7]),
    "tool_call_start": ToolCallStart(index=0, call_id="call_1", name="f", token_ids=[8]),
    "tool_call_args": ToolCallArgsDelta(index=0, fragment='{"a": 1}', token_ids=[9]),
    "tool_call_end": ToolCallEnd(index=0, arguments='{"a": 1}', token_ids=[10]),
    "usage": Usage(input_tokens=3, output_tokens=4, cached_tokens=1, reasoning_tokens=1),
    "finish": Finish(reason="stop_sequence", stop_sequence="##", token_ids=[11]),
    "error": Error(kind="worker_lost", message="gone", retryable=True),
}


def test_pinned_bytes_per_event_type_are_stable() -> None:
    # A changed byte here breaks every stream already recorded in Redis: bump the schema instead.
    assert set(PINNED) == {cls.__struct_config__.tag for cls in get_args(AnyEvent)}
    encoded = {tag: codec.encode_event(event).hex() for tag, event in PINNED.items()}
    if os.environ.get("SLUICE_UPDATE_GOLDEN"):
        FIXTURE.write_text(json.dumps(encoded, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(FIXTURE.read_text())
    assert encoded == pinned
    for tag, hexed in pinned.items():
        assert codec.decode_event(bytes.fromhex(hexed)) == PINNED[tag]


def test_unknown_tag_and_newer_schema_are_protocol_errors() -> None:
    alien = msgspec.msgpack.encode({"type": "hologram", "text": "x"})
    with pytest.raises(ProtocolError):
        codec.decode_event(alien)
    with pytest.raises(ProtocolError, match="newer"):
        codec.decode_entry({b"v": b"99", b"e": codec.encode_event(PINNED["usage"])})
    with pytest.raises(ProtocolError):
        codec.decode_entry({b"e": codec.encode_event(PINNED["usage"])})


def test_job_round_trips_and_rejects_garbage() -> None:
    job = Job(
        request_id="req_9",
        model="m",
        origin="openai_chat",
        messages=[
            Message(role="system", content=[TextPart("be brief")]),
            Message(
                role="assistant",
                tool_calls=[ToolCall(id="call_1", name="f", arguments="{}")],
                reasoning="thought",
            ),
            Message(role="tool", content=[TextPart("42")], tool_call_id="call_1", name="f"),
        ],
        tools=[ToolDef(name="f", parameters={"type": "object", "properties": {}})],
        stop=["\n\n"],
        chat_template_kwargs={"enable_thinking": False},
        reasoning=ReasoningControl(effort="low", visible=False, explicit=True),
        prompt_token_ids=[1, 2, 3],
        prompt_text="<s>be brief",
    )
    assert codec.decode_job(codec.encode_job(job)) == job
    assert job.messages[2].text == "42"
    with pytest.raises(ProtocolError):
        codec.decode_job(b"\x93\x01\x02\x03")


def test_a_job_without_its_prompt_is_rejected() -> None:
    """Workers accept only tokenized jobs: a bare request never reaches a backend."""
    bare = msgspec.msgpack.encode(GenerateRequest(request_id="req_9", model="m"))
    with pytest.raises(ProtocolError, match="prompt_token_ids"):
        codec.decode_job(bare)
