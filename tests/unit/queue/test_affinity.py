"""Cache-aware pickup (``services/queue/affinity.py``) against an in-process fakeredis.

Two "workers" here are a ``Holdings`` (what each publishes) and a ``Claims`` (its poll's
filter) each, on one fakeredis with the scripts run through lupa. Jobs enter through
``Queue.enqueue`` with their prompt's chain, as the API sends them; a pickup is the in-progress
marker arq's worker writes. The consumer's use of them runs in the integration tests.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import fakeredis
import pytest

from services.queue import ENQUEUED, Queue, arq_keys
from services.queue.affinity import Claims, Holdings
from shared import keys
from shared.prefix import prompt_chain

MODEL = "m"
BLOCK = 4
LONG_WAIT_MS = 60_000  # never reached in a test: only a free or gone preferred worker yields
SYSTEM = list(range(100, 132))  # 8 blocks every prompt shares


class Node:
    """One worker's two sides of affinity, with a journal it fills as its prefix cache would."""

    def __init__(self, fake: fakeredis.FakeAsyncRedis, wid: str, slots: int = 4) -> None:
        self.wid, self.slots, self.running = wid, slots, 0
        self.journal: deque[tuple[bool, bytes]] = deque()
        self.holdings = Holdings(fake, MODEL, wid, lambda: (self.slots, self.running), self.journal)
        self.claims = Claims(fake, MODEL, wid)

    async def holds(self, tokens: list[int]) -> None:
        self.journal.extend((True, h) for h in prompt_chain(MODEL, tokens, BLOCK))
        await self.holdings.publish()


@pytest.fixture
async def fake() -> AsyncIterator[fakeredis.FakeAsyncRedis]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


async def enqueue(
    fake: fakeredis.FakeAsyncRedis, jid: str, tokens: list[int], wait_ms: int = LONG_WAIT_MS
) -> None:
    chain = prompt_chain(MODEL, tokens, BLOCK)
    result = await Queue(fake).enqueue(
        MODEL, jid, b"job", enqueue_ms=1_000, expires_ms=60_000, bound=100,
        prefix=chain, affinity_wait_ms=wait_ms,
    )  # fmt: skip
    assert result == ENQUEUED


async def preferred(fake: fakeredis.FakeAsyncRedis, jid: str) -> tuple[str, int] | None:
    raw = await fake.get(keys.affinity_preference(jid))
    if raw is None:
        return None
    wid, _, blocks = raw.decode().rsplit(" ", 2)
    return wid, int(blocks)


async def members(fake: fakeredis.FakeAsyncRedis, key: str) -> set[bytes]:
    return set(await fake.execute_command("SMEMBERS", key))  # type: ignore[no-untyped-call]


def session(n: int, turns: int = 1) -> list[int]:
    """A session's prompt after ``turns`` turns: the shared system prompt, then its own."""
    return [*SYSTEM, *(1000 * n + i for i in range(12 * turns))]


async def test_the_worker_holding_the_longest_prefix_is_preferred(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    a, b = Node(fake, "a"), Node(fake, "b", slots=8)
    await a.holds(session(1, turns=2))  # system prompt + session 1's two turns
    await b.holds(session(2))  # system prompt + session 2: more free slots, shorter match
    await enqueue(fake, "turn3", session(1, turns=3))
    assert await preferred(fake, "turn3") == ("a", 8 + 6)
    await enqueue(fake, "other", session(2, turns=2))
    assert await preferred(fake, "other") == ("b", 8 + 3)


async def test_a_tie_goes_to_the_freer_worker_and_a_burst_spreads(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    """Both hold the system prompt: new sessions go where slots are free, and each preference
    reserves one until the worker publishes again, so a burst does not all go to one."""
    a, b = Node(fake, "a", slots=2), Node(fake, "b", slots=2)
    await a.holds(SYSTEM)
    await b.holds(SYSTEM)
    for i in range(4):
        await enqueue(fake, f"s{i}", session(10 + i))
    chosen = [await preferred(fake, f"s{i}") for i in range(4)]
    assert sorted(chosen) == [("a", 8), ("a", 8), ("b", 8), ("b", 8)]  # type: ignore[type-var]
    await enqueue(fake, "s4", session(14))  # every slot reserved: nobody is preferred
    assert await preferred(fake, "s4") is None


async def test_a_far_busier_worker_is_passed_over_whatever_it_holds(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    """SGLang's balance guard: more than 2 jobs beyond the least busy worker and over 1.5x."""
    a, b = Node(fake, "a", slots=64), Node(fake, "b", slots=64)
    a.running, b.running = 8, 6  # within the guard: the cache decides
    await a.holds(session(1, turns=2))
    await b.holds(SYSTEM)
    await enqueue(fake, "near", session(1, turns=3))
    assert await preferred(fake, "near") == ("a", 8 + 6)
    a.running, b.running = 10, 6  # 4 more, and 1.67x: a is passed over
    await a.holdings.publish()
    await b.holdings.publish()
    await enqueue(fake, "far", session(1, turns=3))
    assert await preferred(fake, "far") == ("b", 8)


async def test_nothing_held_still_spreads_new_prompts(fake: fakeredis.FakeAsyncRedis) -> None:
    a = Node(fake, "a", slots=1)
    await a.holdings.publish()
    await enqueue(fake, "cold", [7] * 12)
    assert await preferred(fake, "cold") == ("a", 0)


async def test_the_preferred_worker_takes_the_job_at_once_and_others_wait(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    a, b = Node(fake, "a"), Node(fake, "b")
    await a.holds(session(1))
    await b.holds(SYSTEM)
    await enqueue(fake, "j", session(1, turns=2))
    taken, soonest = await b.claims.claimable(["j"])
    assert taken == {}
    assert soonest is not None and 0 < soonest <= LONG_WAIT_MS / 1000
    taken, soonest = await a.claims.claimable(["j"])
    assert (taken, soonest) == ({"j": "hit"}, None)


async def test_after_the_wait_anyone_takes_the_job(fake: fakeredis.FakeAsyncRedis) -> None:
    a, b = Node(fake, "a"), Node(fake, "b")
    await a.holds(session(1))
    await enqueue(fake, "j", session(1, turns=2), wait_ms=1)
    await asyncio.sleep(0.01)  # past the 1 ms deadline on any clock
    assert await b.claims.claimable(["j"]) == ({"j": "after_wait"}, None)


async def test_a_full_or_gone_preferred_worker_is_not_waited_for(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    a, b = Node(fake, "a"), Node(fake, "b")
    await a.holds(session(1))
    await enqueue(fake, "j", session(1, turns=2))
    assert (await b.claims.claimable(["j"]))[0] == {}
    a.slots = 0  # it filled up since
    await a.holdings.publish()
    assert await b.claims.claimable(["j"]) == ({"j": "busy"}, None)
    a.slots = 4
    await a.holdings.publish()
    assert (await b.claims.claimable(["j"]))[0] == {}
    # its entry expired: presumed dead
    await fake.execute_command("HDEL", keys.affinity_holders(MODEL), "a")  # type: ignore[no-untyped-call]
    assert await b.claims.claimable(["j"]) == ({"j": "busy"}, None)


async def test_jobs_without_a_preference_or_running_elsewhere(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    a = Node(fake, "a")
    assert await Queue(fake).enqueue(
        MODEL, "plain", b"job", enqueue_ms=1, expires_ms=60_000, bound=100
    ) == ENQUEUED  # fmt: skip
    await enqueue(fake, "nobody", session(3))  # no worker publishes: no preference
    await fake.set(arq_keys.in_progress("running"), b"1")
    assert await a.claims.claimable(["plain", "nobody", "running"]) == (
        {"plain": "miss", "nobody": "miss"},
        None,
    )


async def test_holdings_publish_changes_and_resend_after_a_loss(
    fake: fakeredis.FakeAsyncRedis,
) -> None:
    a = Node(fake, "a")
    chain = prompt_chain(MODEL, session(1), BLOCK)
    await a.holds(session(1))
    blocks = keys.affinity_blocks("a")
    assert await members(fake, blocks) == set(chain)
    a.journal.append((False, chain[-1]))  # evicted
    await a.holdings.publish()
    assert await members(fake, blocks) == set(chain[:-1])
    assert 0 < await fake.pttl(blocks) <= 3_000
    await fake.delete(blocks)  # Redis lost it (a restart, or expiry while the worker stalled)
    a.journal.append((True, chain[-1]))
    await a.holdings.publish()  # sends the change, sees the set is short
    assert await members(fake, blocks) == {chain[-1]}
    await a.holdings.publish()  # and sends everything
    assert await members(fake, blocks) == set(chain)
    await a.holdings.retire()
    assert not await fake.exists(blocks)
    assert not await fake.execute_command("HEXISTS", keys.affinity_holders(MODEL), "a")  # type: ignore[no-untyped-call]
