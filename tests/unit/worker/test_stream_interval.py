"""Pacing a request's batches (``SLUICE_STREAM_INTERVAL_S``, ``handoff.Mailbox``): the decode
thread delivers one batch per step; the backend hands on what waits, plus what arrives before
the next batch is due, joined. A terminal event or an error never waits for the due time. The
waits are bounded by a hang guard far above what each case needs, not timed. The decode thread's
``Outbox`` delivers each thread's puts in order, with one wake-up of the loop per burst."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from services.worker.handoff import Mailbox, Outbox
from shared.events import AnyEvent, Finish, TextDelta

GUARD_S = 30.0  # far above any case: a hang fails instead of blocking the suite


def text(s: str, token: int) -> list[AnyEvent]:
    return [TextDelta(text=s, token_ids=[token])]


def mailbox() -> Mailbox:
    return Mailbox(asyncio.get_running_loop())


async def gather(box: Mailbox, due: float | None) -> list[AnyEvent]:
    """The batch, when no error came with it."""
    async with asyncio.timeout(GUARD_S):
        events, error = await box.take(due)
    assert error is None
    return events


async def test_what_waits_past_the_due_time_goes_out_as_one_batch() -> None:
    queue = mailbox()
    for i, s in enumerate("abc"):
        queue.put(text(s, i))
    assert await gather(queue, due=0.0) == [TextDelta(text="abc", token_ids=[0, 1, 2])]
    assert not queue._items


async def test_without_pacing_each_step_goes_out_alone() -> None:
    """``SLUICE_STREAM_INTERVAL_S=0``: a batch per decode step, however many wait."""
    queue = mailbox()
    for i, s in enumerate("ab"):
        queue.put(text(s, i))
    queue.put(RuntimeError("boom"))
    assert await gather(queue, due=None) == text("a", 0)
    assert await gather(queue, due=None) == text("b", 1)
    events, error = await queue.take(due=None)
    assert events == [] and isinstance(error, RuntimeError)


async def test_steps_that_arrive_before_the_due_time_join_the_batch() -> None:
    loop = asyncio.get_running_loop()
    queue = mailbox()
    queue.put(text("a", 1))
    loop.call_later(0.01, queue.put, text("b", 2))
    loop.call_later(0.02, queue.put, text("c", 3))
    batch = await gather(queue, due=loop.time() + 0.5)
    assert batch == [TextDelta(text="abc", token_ids=[1, 2, 3])]


async def test_a_terminal_event_goes_out_without_waiting_for_the_due_time() -> None:
    loop = asyncio.get_running_loop()
    queue = mailbox()
    queue.put(text("a", 1))
    finish: list[AnyEvent] = [Finish(reason="end_turn")]
    loop.call_later(0.01, queue.put, finish)
    batch = await gather(queue, due=loop.time() + 10 * GUARD_S)
    assert batch == [TextDelta(text="a", token_ids=[1]), Finish(reason="end_turn")]


async def test_an_error_lets_the_events_before_it_out_first() -> None:
    queue = mailbox()
    queue.put(text("a", 1))
    queue.put(RuntimeError("boom"))
    queue.put(text("later", 9))
    events, error = await queue.take(due=asyncio.get_running_loop().time() + GUARD_S)
    assert events == text("a", 1)
    assert isinstance(error, RuntimeError)
    assert str(error) == "boom"


async def test_a_step_after_the_due_time_goes_out_alone() -> None:
    loop = asyncio.get_running_loop()
    queue = mailbox()
    loop.call_later(0.02, queue.put, text("a", 1))
    loop.call_later(10 * GUARD_S, queue.put, text("b", 2))  # long after the guard
    assert await gather(queue, due=loop.time()) == text("a", 1)


async def test_the_outbox_hands_a_threads_puts_over_in_order_with_one_wake_up_per_burst(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    outbox, boxes = Outbox(loop), [mailbox(), mailbox()]
    wake_ups = 0
    call = loop.call_soon_threadsafe

    def counted(*args: Any) -> Any:
        nonlocal wake_ups
        wake_ups += 1
        return call(*args)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)

    def step() -> None:  # a decode step: every sequence's batch, the loop busy meanwhile
        for i in range(5):
            for box in boxes:
                outbox.put(box, text(str(i), i))

    decode = threading.Thread(target=step)
    decode.start()
    decode.join()  # blocks the loop: the burst is all queued before it runs
    for box in boxes:
        assert await gather(box, due=0.0) == [TextDelta(text="01234", token_ids=[0, 1, 2, 3, 4])]
    assert wake_ups == 1
    last = threading.Thread(target=outbox.put, args=(boxes[0], [Finish(reason="end_turn")]))
    last.start()
    last.join()
    assert await gather(boxes[0], due=None) == [Finish(reason="end_turn")]
    assert wake_ups == 2
