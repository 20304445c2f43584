"""Folding a backlog's deltas: what a reader gets is the same answer, resumable at every id.

The logs are the factory scenarios cut into entries at random places (a decode step's events
share an entry) and read in batches cut at random places (what a live reader finds waiting).
For the Chat and Messages projectors (the two that fold), against the same events projected one
by one without folding, as the golden transcripts are:

- fold equals concatenation: ``fold`` of the folded events is ``fold`` of the log;
- the accumulated answer (the openai SDK's chunk accumulator; Anthropic's text, thinking and
  tool input per block) is the same however the log is cut into entries and batches;
- resuming after any ``id:`` a reader saw gives exactly the rest: nothing lost, nothing twice;
- the same batch always gives the same bytes (a replay reads a finished log as one batch).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hypothesis import given, settings, strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from services.api.coalesce import MAX_FOLD_CHARS, Item, fold_deltas
from services.api.streaming import Projector
from services.api.wire import sse
from services.api.wire.anthropic_messages import Context as MsgContext, Projector as MsgProjector
from services.api.wire.openai_chat import Context as ChatContext, Projector as ChatProjector
from shared.accumulate import fold
from shared.events import AnyEvent, TextDelta, is_terminal
from tests.factories import SCENARIOS

NAMES = sorted(SCENARIOS)


def chat() -> Projector:
    ctx = ChatContext(id="c", created=1, model="m", include_usage=True, include_reasoning=True)
    return ChatProjector(ctx)


def messages() -> Projector:
    return MsgProjector(MsgContext(message_id="msg_1", model="m"))


def entries(events: list[AnyEvent], cuts: list[bool]) -> list[Item]:
    """The log as items: an entry ends after event i when ``cuts[i]`` (and after the last)."""
    items: list[Item] = []
    n = 0
    for i, event in enumerate(events):
        ends = i == len(events) - 1 or cuts[i % len(cuts)]
        items.append((f"1-{n}", event, ends))
        n += ends
    return items


def batches(items: list[Item], cuts: list[bool]) -> list[list[Item]]:
    """Split at entry ends only (the hub hands out whole entries), where ``cuts`` says."""
    out: list[list[Item]] = [[]]
    for i, item in enumerate(items):
        out[-1].append(item)
        if item[2] and cuts[i % len(cuts)] and i < len(items) - 1:
            out.append([])
    return out


def stream(make: Callable[[], Projector], parts: list[list[Item]], folds: bool) -> list[bytes]:
    """The SSE events a reader gets, as ``streaming._frames`` writes them."""
    projector = make()
    out: list[bytes] = []
    for batch in parts:
        for entry_id, event, ends in fold_deltas(batch) if folds else batch:
            frames = projector.feed(event)
            for i, frame in enumerate(frames):
                last = i == len(frames) - 1
                out.append(sse.encode(frame, entry_id if (ends and last) else None))
            if is_terminal(event):
                out.extend(sse.encode(f) for f in projector.close())
    return out


def after(items: list[Item], entry_id: str) -> list[Item]:
    ids = [i for i, _, _ in items]
    return items[len(ids) - ids[::-1].index(entry_id) :]


def answer(make: Callable[[], Projector], frames: list[bytes]) -> object:
    """What a client builds from the frames, independent of how deltas were split."""
    datas = [f.split(b"data: ", 1)[1].split(b"\n")[0] for f in frames if b"data: " in f]
    if make is chat:
        state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
        errors = [data for data in datas if data.startswith(b'{"error"')]
        for data in datas:
            if data != b"[DONE]" and data not in errors:
                state.handle_chunk(ChatCompletionChunk.model_validate_json(data))
        try:
            built: object = state.get_final_completion().model_dump()
        except Exception:  # an error before any chunk: nothing to accumulate
            built = None
        return built, errors
    blocks: dict[int, str] = {}
    kinds = []
    for data in datas:
        obj = json.loads(data)
        kinds.append(obj["type"])
        if obj["type"] == "content_block_delta":
            delta = obj["delta"]
            text = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
            blocks[obj["index"]] = blocks.get(obj["index"], "") + text + delta.get("signature", "")
    return blocks, [k for k in kinds if k != "content_block_delta"]


CUTS = st.lists(st.booleans(), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), entry_cuts=CUTS, batch_cuts=CUTS)
def test_fold_equals_concatenation(
    name: str, entry_cuts: list[bool], batch_cuts: list[bool]
) -> None:
    events = SCENARIOS[name]()
    items = entries(events, entry_cuts)
    folded = [e for part in batches(items, batch_cuts) for _, e, _ in fold_deltas(part)]
    assert fold(folded) == fold(events)
    assert len(folded) <= len(events)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    make=st.sampled_from([chat, messages]),
    entry_cuts=CUTS,
    batch_cuts=CUTS,
)
def test_resume_after_every_id_loses_and_repeats_nothing(
    name: str, make: Callable[[], Projector], entry_cuts: list[bool], batch_cuts: list[bool]
) -> None:
    items = entries(SCENARIOS[name](), entry_cuts)
    whole = answer(make, stream(make, [items], folds=False))
    live = stream(make, batches(items, batch_cuts), folds=True)
    assert answer(make, live) == whole
    for n, frame in enumerate(live):
        if b"\nid: " not in b"\n" + frame:
            continue
        entry_id = frame.split(b"id: ", 1)[1].split(b"\n")[0].decode()
        # The resume: the projector caught up on the entries up to the id (frames discarded),
        # then the rest read as one batch (a finished log), folded.
        projector = make()
        seen = [(i, e, end) for i, e, end in items if (i, e, end) not in after(items, entry_id)]
        for _, event, _ in seen:
            projector.feed(event)
        rest: list[bytes] = []
        for rid, event, ends in fold_deltas(after(items, entry_id)):
            frames = projector.feed(event)
            rest += [
                sse.encode(f, rid if ends and i == len(frames) - 1 else None)
                for i, f in enumerate(frames)
            ]
            if is_terminal(event):
                rest += [sse.encode(f) for f in projector.close()]
        assert answer(make, live[: n + 1] + rest) == whole


@given(name=st.sampled_from(NAMES), make=st.sampled_from([chat, messages]), cuts=CUTS)
def test_a_replay_is_the_same_bytes_every_time(
    name: str, make: Callable[[], Projector], cuts: list[bool]
) -> None:
    items = entries(SCENARIOS[name](), cuts)
    assert stream(make, [items], folds=True) == stream(make, [items], folds=True)


def test_a_backlog_of_tokens_becomes_one_frame_with_the_last_id() -> None:
    items: list[Item] = [(f"1-{i}", TextDelta(text="ab", token_ids=[i]), True) for i in range(5)]
    assert fold_deltas(items) == [("1-4", TextDelta(text="ab" * 5, token_ids=list(range(5))), True)]


def test_a_run_never_reaches_into_the_middle_of_the_next_entry() -> None:
    a = TextDelta(text="a", token_ids=[1])
    items: list[Item] = [("1-0", a, True), ("1-1", a, False), ("1-1", a, True)]
    # Joining the first into the second would leave no id on the wire for entry 1-0.
    assert [(i, e.text, end) for i, e, end in fold_deltas(items)] == [  # type: ignore[union-attr]
        ("1-0", "a", True),
        ("1-1", "aa", True),
    ]


def test_runs_stop_growing_at_the_frame_size_cap() -> None:
    chunk = "x" * 1000
    items: list[Item] = [(f"1-{i}", TextDelta(text=chunk), True) for i in range(40)]
    folded = fold_deltas(items)
    assert "".join(e.text for _, e, _ in folded) == chunk * 40  # type: ignore[union-attr]
    assert all(len(e.text) <= MAX_FOLD_CHARS + 1000 for _, e, _ in folded)  # type: ignore[union-attr]
    assert len(folded) == 3
