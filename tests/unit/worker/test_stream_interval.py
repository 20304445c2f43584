"""Pacing a request's batches (``SLUICE_STREAM_INTERVAL_S``, ``torch_backend._gather``): the
decode thread queues one batch per step; the backend hands on what waits, plus what arrives
before the next batch is due, joined. A terminal event or an error never waits for the due time.
The waits are bounded by a hang guard far above what each case needs, not timed."""

from __future__ import annotations

import asyncio

from services.worker.torch_backend import _gather
from shared.events import AnyEvent, Finish, TextDelta

Queue = asyncio.Queue[list[AnyEvent] | BaseException]
GUARD_S = 30.0  # far above any case: a hang fails instead of blocking the suite


def text(s: str, token: int) -> list[AnyEvent]:
    return [TextDelta(text=s, token_ids=[token])]


async def gather(queue: Queue, due: float | None) -> list[AnyEvent]:
    """The batch, when no error came with it."""
    async with asyncio.timeout(GUARD_S):
        events, error = await _gather(queue, due)
    assert error is None
    return events


async def test_what_waits_past_the_due_time_goes_out_as_one_batch() -> None:
    queue: Queue = asyncio.Queue()
    for i, s in enumerate("abc"):
        queue.put_nowait(text(s, i))
    assert await gather(queue, due=0.0) == [TextDelta(text="abc", token_ids=[0, 1, 2])]
    assert queue.empty()


async def test_without_pacing_each_step_goes_out_alone() -> None:
    """``SLUICE_STREAM_INTERVAL_S=0``: a batch per decode step, however many wait."""
    queue: Queue = asyncio.Queue()
    for i, s in enumerate("ab"):
        queue.put_nowait(text(s, i))
    queue.put_nowait(RuntimeError("boom"))
    assert await gather(queue, due=None) == text("a", 0)
    assert await gather(queue, due=None) == text("b", 1)
    events, error = await _gather(queue, due=None)
    assert events == [] and isinstance(error, RuntimeError)


async def test_steps_that_arrive_before_the_due_time_join_the_batch() -> None:
    loop = asyncio.get_running_loop()
    queue: Queue = asyncio.Queue()
    queue.put_nowait(text("a", 1))
    loop.call_later(0.01, queue.put_nowait, text("b", 2))
    loop.call_later(0.02, queue.put_nowait, text("c", 3))
    batch = await gather(queue, due=loop.time() + 0.5)
    assert batch == [TextDelta(text="abc", token_ids=[1, 2, 3])]


async def test_a_terminal_event_goes_out_without_waiting_for_the_due_time() -> None:
    loop = asyncio.get_running_loop()
    queue: Queue = asyncio.Queue()
    queue.put_nowait(text("a", 1))
    loop.call_later(0.01, queue.put_nowait, [Finish(reason="end_turn")])
    batch = await gather(queue, due=loop.time() + 10 * GUARD_S)
    assert batch == [TextDelta(text="a", token_ids=[1]), Finish(reason="end_turn")]


async def test_an_error_lets_the_events_before_it_out_first() -> None:
    queue: Queue = asyncio.Queue()
    queue.put_nowait(text("a", 1))
    queue.put_nowait(RuntimeError("boom"))
    queue.put_nowait(text("later", 9))
    events, error = await _gather(queue, due=asyncio.get_running_loop().time() + GUARD_S)
    assert events == text("a", 1)
    assert isinstance(error, RuntimeError)
    assert str(error) == "boom"


async def test_a_step_after_the_due_time_goes_out_alone() -> None:
    loop = asyncio.get_running_loop()
    queue: Queue = asyncio.Queue()
    loop.call_later(0.02, queue.put_nowait, text("a", 1))
    loop.call_later(10 * GUARD_S, queue.put_nowait, text("b", 2))  # long after the guard
    assert await gather(queue, due=loop.time()) == text("a", 1)
