"""Byte-stable transcripts of a request with ``n`` > 1: several choices' events, interleaved in a
fixed order, merged into one Chat (and one legacy Completions) stream.

Regenerate with ``SLUICE_UPDATE_GOLDEN=1``; review the diff like code. What a client builds from
the Chat transcript with the openai SDK's own accumulator is checked too.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from services.api.wire import openai_chat, openai_completions
from services.api.wire.choices import ChoiceMerge
from services.api.wire.sse import encode
from shared.events import AnyEvent
from tests.factories import SCENARIOS
from tests.golden.golden_io import assert_golden

GOLDEN_DIR = Path(__file__).parent / "choices"
CASES = {
    # choice 0 thinks first (hidden), so choice 1 streams before it: choice 0 is opened first
    "chat.reasoning_text_tool_call": ("reasoning", "text", "tool_call"),
    "chat.max_tokens_stop_sequence": ("max_tokens", "stop_sequence"),
    "completions.text_max_tokens": ("text", "max_tokens"),
}


def round_robin(streams: list[list[AnyEvent]]) -> list[tuple[int, AnyEvent]]:
    """One event of each unfinished choice in turn: a fixed interleaving."""
    out: list[tuple[int, AnyEvent]] = []
    for k in range(max(map(len, streams))):
        out += [(i, s[k]) for i, s in enumerate(streams) if k < len(s)]
    return out


def transcript(case: str) -> bytes:
    streams = [SCENARIOS[name]() for name in CASES[case]]
    n = len(streams)
    if case.startswith("chat."):
        chat = openai_chat.Context(
            id="chatcmpl-0000000000000001", created=1_700_000_000, model="m", include_usage=True
        )
        chats = [
            openai_chat.Projector(msgspec.structs.replace(chat, index=i, n=n)) for i in range(n)
        ]
        merge = ChoiceMerge(chats, lambda usage: openai_chat.usage_chunk(chat, usage))
    else:
        text = openai_completions.Context(
            id="cmpl-0000000000000001", created=1_700_000_000, model="m", include_usage=True
        )
        texts = [
            openai_completions.Projector(msgspec.structs.replace(text, index=i, n=n))
            for i in range(n)
        ]
        merge = ChoiceMerge(texts, lambda usage: openai_completions.usage_chunk(text, usage))
    frames = [f for i, event in round_robin(streams) for f in merge.feed(i, event)]
    return b"".join(encode(f) for f in [*frames, *merge.close()])


@pytest.mark.parametrize("case", list(CASES))
def test_transcript_matches_golden(case: str) -> None:
    assert_golden(GOLDEN_DIR / f"{case}.sse", transcript(case))


def test_every_golden_file_has_a_case() -> None:
    assert {p.stem for p in GOLDEN_DIR.glob("*.sse")} == set(CASES)


def test_the_sdk_reads_every_choice() -> None:
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for line in transcript("chat.reasoning_text_tool_call").split(b"\n"):
        if line.startswith(b"data: {"):
            state.handle_chunk(ChatCompletionChunk.model_validate_json(line[6:]))
    choices = state.current_completion_snapshot.choices
    assert [c.index for c in choices] == [0, 1, 2]
    assert [c.finish_reason for c in choices] == ["stop", "stop", "tool_calls"]
    assert choices[0].message.content == "Hi there." and choices[1].message.content
    assert choices[2].message.content is None and choices[2].message.tool_calls
