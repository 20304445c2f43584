"""``Subscription`` on its own: waits that time out and wake, and runs of entries at high water.

The hub's side is a plain owner with the two water marks and a ``wake`` that counts its calls
(the real hub against Redis is ``tests/integration/test_api_hub.py``).
"""

from __future__ import annotations

import asyncio

import pytest

from services.api.stream_ids import parse_id
from services.api.subscription import Entry, HubClosed, Subscription


class Owner:
    def __init__(self, high_water: int = 4) -> None:
        self.high_water = high_water
        self.low_water = high_water // 4
        self.wakes = 0

    async def wake(self) -> None:
        self.wakes += 1


def run(first: int, n: int) -> list[Entry]:
    return [(f"{i}-0", {b"i": str(i).encode()}) for i in range(first, first + n)]


def push_run(sub: Subscription, entries: list[Entry]) -> None:
    sub._push_run(entries, parse_id(entries[-1][0]))


async def test_a_wait_that_passes_returns_nothing_and_a_later_entry_still_arrives() -> None:
    sub = Subscription(Owner(), "k", "0-0")
    assert await asyncio.wait_for(sub.get_batch(0.01), 5) == []
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, push_run, sub, run(1, 1))
    assert await asyncio.wait_for(sub.get_batch(30), 5) == run(1, 1)


async def test_a_short_wait_after_a_long_one_ends_at_its_own_deadline() -> None:
    """The long wait's timer is still armed; the short wait must not inherit its deadline."""
    sub = Subscription(Owner(), "k", "0-0")
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, push_run, sub, run(1, 1))
    assert await asyncio.wait_for(sub.get_batch(60), 5) == run(1, 1)
    assert await asyncio.wait_for(sub.get_batch(0.02), 5) == []


async def test_a_long_wait_after_a_short_one_is_not_cut_short() -> None:
    """The short wait's timer fires during the long wait: it re-arms instead of ending it."""
    sub = Subscription(Owner(), "k", "0-0")
    assert await sub.get_batch(0.01) == []
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, push_run, sub, run(1, 2))
    assert await asyncio.wait_for(sub.get_batch(30), 5) == run(1, 2)


async def test_a_run_fills_the_buffer_to_high_water_and_pauses_there() -> None:
    owner = Owner(high_water=4)
    sub = Subscription(owner, "k", "0-0")
    push_run(sub, run(1, 3))
    assert not sub.paused and sub.cursor == "3-0"
    push_run(sub, run(4, 5))  # only one fits
    assert sub.paused and sub.cursor == "4-0" and sub.cursor_id == (4, 0)
    assert [e[0] for e in await sub.get_batch(0)] == ["1-0", "2-0", "3-0", "4-0"]
    assert not sub.paused and owner.wakes == 1  # drained below low water: the hub re-reads


async def test_closing_ends_a_wait_with_hub_closed() -> None:
    sub = Subscription(Owner(), "k", "0-0")
    asyncio.get_running_loop().call_later(0.01, sub._close)
    with pytest.raises(HubClosed):
        await asyncio.wait_for(sub.get_batch(30), 5)
