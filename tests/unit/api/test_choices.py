"""``n`` > 1 without a server: choice ids and seeds, the merged stream's resume ids, and the merge
of n interleaved event streams into Chat and Completions chunks, against the fold of each choice.

A client reads the merged chunks with the openai SDK's own accumulator (Chat) or by concatenating
``choices[].text`` per index (Completions); whatever the interleaving, it must build exactly the
non-streamed body (``render_choices`` of each choice's fold), with the usage counted once.
"""

from __future__ import annotations

import json
import random
from types import ModuleType
from typing import Any

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from services.api.stream_ids import START, parse_positions, positions_id
from services.api.wire import openai_chat, openai_completions
from services.api.wire.choices import ChoiceMerge, merge_usage
from services.api.wire.sse import Frame
from shared.accumulate import fold
from shared.events import AnyEvent, Error, Finish, Start, TextDelta, Usage
from shared.jobs import choice_id, choice_seed
from tests.factories import SCENARIOS

CHAT = openai_chat.Context(id="chatcmpl_1", created=1, model="m", include_usage=True)
TEXT = openai_completions.Context(id="cmpl_1", created=1, model="m", include_usage=True)


def test_choice_ids_keep_the_request_id_for_choice_0() -> None:
    assert [choice_id("chatcmpl_ab", i) for i in range(3)] == [
        "chatcmpl_ab",
        "chatcmpl_ab.1",
        "chatcmpl_ab.2",
    ]
    assert ":" not in choice_id("r", 5)  # ":" is a continuation's job id


def test_choice_seeds_differ_and_wrap_within_64_bits() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None
    assert choice_seed(2**64 - 1, 1) == 0 and choice_seed(2**64 - 2, 1) == 2**64 - 1
    assert choice_seed(-5, 2) == -3


def test_positions_round_trip() -> None:
    ids = ["1764230000000-0", START, "1764230000003-12"]
    assert parse_positions(positions_id(ids), 3) == ids
    assert parse_positions(START, 4) == [START] * 4  # a bare start: every choice from its start


@pytest.mark.parametrize(
    "text",
    ["1-0,2-0", "1-0,2-0,3-0,4-0", "1-0,,2-0", "1-0, 2-0,3-0", "1-0;2-0;3-0", "a,b,c", "1-0"],
)
def test_positions_are_refused_unless_one_id_per_choice(text: str) -> None:
    with pytest.raises(ValueError, match="stream id"):
        parse_positions(text, 3)


def test_usage_counts_the_prompt_once_and_sums_the_rest() -> None:
    usages = [
        Usage(input_tokens=20, output_tokens=5, cached_tokens=0, reasoning_tokens=1),
        None,  # a choice cut before its usage (cancelled, or failed)
        Usage(input_tokens=20, output_tokens=7, cached_tokens=16, reasoning_tokens=2),
    ]
    assert merge_usage(usages) == Usage(
        input_tokens=20, output_tokens=12, cached_tokens=0, reasoning_tokens=3
    )
    assert merge_usage([None, None]) is None


def test_a_prompt_batch_counts_each_prompt_once() -> None:
    """Two prompts with two choices each: each prompt's tokens once (the first choice of its
    run that reported usage), completions summed."""
    usages = [
        Usage(input_tokens=10, output_tokens=3, cached_tokens=0),
        Usage(input_tokens=10, output_tokens=4, cached_tokens=9),
        None,
        Usage(input_tokens=30, output_tokens=5, cached_tokens=16),
    ]
    assert merge_usage(usages, prompts=2) == Usage(
        input_tokens=40, output_tokens=12, cached_tokens=16
    )


def interleave(streams: list[list[AnyEvent]], seed: int) -> list[tuple[int, AnyEvent]]:
    """The choices' events in one random arrival order, each choice's own order kept."""
    rng = random.Random(seed)
    cursors = [0] * len(streams)
    out = []
    while any(c < len(s) for c, s in zip(cursors, streams, strict=True)):
        i = rng.choice([k for k, s in enumerate(streams) if cursors[k] < len(s)])
        out.append((i, streams[i][cursors[i]]))
        cursors[i] += 1
    return out


def merged(fmt: ModuleType, ctx: Any, streams: list[list[AnyEvent]], seed: int) -> list[Frame]:
    """The frames of ``streams`` merged as one answer in ``fmt`` (a wire format package)."""
    n = len(streams)
    merge = ChoiceMerge(
        [fmt.Projector(msgspec.structs.replace(ctx, index=i, n=n)) for i in range(n)],
        lambda usage: fmt.usage_chunk(ctx, usage),
    )
    frames = [f for i, event in interleave(streams, seed) for f in merge.feed(i, event)]
    assert merge.ended and not merge.failed
    return frames + merge.close() + merge.close()  # the end goes out once


CHAT_SCENARIOS = ["text", "tool_call", "reasoning", "parallel_tool_calls", "max_tokens"]


@pytest.mark.parametrize("seed", range(6))
def test_chat_chunks_build_the_non_streamed_body(seed: int) -> None:
    streams = [SCENARIOS[name]() for name in CHAT_SCENARIOS]
    frames = merged(openai_chat, CHAT, streams, seed)
    assert frames[-1].data == b"[DONE]" and b"[DONE]" not in [f.data for f in frames[:-1]]
    chunks = [ChatCompletionChunk.model_validate_json(f.data) for f in frames[:-1]]
    assert chunks[-1].choices == [] and all(c.choices for c in chunks[:-1])  # usage once, last
    roles = [c.choices[0].index for c in chunks[:-1] if c.choices[0].delta.role]
    assert sorted(roles) == [0, 1, 2, 3, 4]  # each choice's role once
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.model_dump(exclude_none=True)
    body = openai_chat.render_choices([fold(s) for s in streams], CHAT)
    whole = json.loads(msgspec.json.encode(body))
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3, 4]
    for got, want in zip(streamed["choices"], whole["choices"], strict=True):
        assert got["index"] == want["index"]
        assert got["finish_reason"] == want["finish_reason"]
        assert got["message"].get("content") == want["message"]["content"]
        calls = [c["function"] for c in got["message"].get("tool_calls", [])]
        assert calls == [c["function"] for c in want["message"].get("tool_calls", [])]
    assert streamed["usage"] == whole["usage"]
    assert whole["usage"]["prompt_tokens"] == 12  # once, not five times
    outputs = sum(next(e for e in s if isinstance(e, Usage)).output_tokens for s in streams)
    assert whole["usage"]["completion_tokens"] == outputs


@pytest.mark.parametrize("seed", range(4))
def test_completion_chunks_build_the_non_streamed_body(seed: int) -> None:
    ctx = msgspec.structs.replace(TEXT, echo="Say: ")
    streams = [SCENARIOS["text"](), SCENARIOS["max_tokens"](), SCENARIOS["stop_sequence"]()]
    frames = merged(openai_completions, ctx, streams, seed)
    assert frames[-1].data == b"[DONE]"
    chunks = [json.loads(f.data) for f in frames[:-1]]
    texts = ["", "", ""]
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    body = json.loads(
        msgspec.json.encode(
            openai_completions.render_choices([fold(s) for s in streams], [ctx] * 3)
        )
    )
    assert texts == [c["text"] for c in body["choices"]]
    assert all(t.startswith("Say: ") for t in texts)  # each choice echoes the prompt
    assert finishes == {c["index"]: c["finish_reason"] for c in body["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_a_failed_choice_ends_the_answer() -> None:
    merge = ChoiceMerge(
        [openai_chat.Projector(msgspec.structs.replace(CHAT, index=i, n=2)) for i in range(2)],
        lambda usage: openai_chat.usage_chunk(CHAT, usage),
    )
    start = Start(request_id="r", model="m", prompt_tokens=3)
    assert merge.feed(0, start) == [] and merge.feed(1, start) == []
    opened, text = merge.feed(1, TextDelta(text="a", token_ids=[1]))
    # choice 0 shows first (as an empty opening chunk): the SDK numbers choices as they appear
    assert json.loads(opened.data)["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": None, "refusal": None},
        "logprobs": None,
        "finish_reason": None,
    }
    assert json.loads(text.data)["choices"][0]["delta"]["content"] == "a"
    frames = merge.feed(0, Error(kind="internal", message="boom", retryable=True))
    assert [json.loads(f.data)["error"]["message"] for f in frames] == ["boom"]
    assert merge.ended and merge.failed
    assert merge.feed(1, TextDelta(text="b", token_ids=[2])) == []  # nothing after the error
    assert merge.feed(1, Finish(reason="end_turn")) == []
    assert [f.data for f in merge.close()] == [b"[DONE]"]


def test_a_broken_stream_fails_once() -> None:
    merge = ChoiceMerge(
        [openai_chat.Projector(msgspec.structs.replace(CHAT, index=i, n=2)) for i in range(2)],
        lambda usage: openai_chat.usage_chunk(CHAT, usage),
    )
    frames = merge.fail(Error(kind="worker_lost", message="lost", retryable=True))
    assert b"lost" in frames[0].data and frames[-1].data == b"[DONE]"
    assert merge.fail(Error(kind="internal", message="again")) == []


def test_a_choice_with_its_own_index_streams_it_and_no_usage() -> None:
    ctx = msgspec.structs.replace(CHAT, index=2, n=3)
    frames = [f for e in SCENARIOS["text"]() for f in openai_chat.Projector(ctx).feed(e)]
    chunks = [json.loads(f.data) for f in frames]
    assert {c["choices"][0]["index"] for c in chunks} == {2}  # no usage chunk: the merge's
