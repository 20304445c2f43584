"""The KV block pool: allocation order, reference counts, the hash chain and LRU eviction."""

from __future__ import annotations

from collections import deque

import pytest

from services.worker.block_pool import BlockPool, NoFreeBlocks, chain_hashes, root_hash
from shared.prefix import prompt_chain

ROOT = root_hash("m")


def hashes(tokens: list[int], size: int = 4) -> list[bytes]:
    out: list[bytes] = []
    chain_hashes(tokens, len(tokens), size, out, ROOT)
    return out


def test_the_chain_covers_whole_prefixes_and_the_model() -> None:
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # the ninth token is not a full block
    b = hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, other prefix: another hash
    assert hashes([1, 2, 3, 4, 5, 6, 7, 8]) == a
    other: list[bytes] = []
    chain_hashes([1, 2, 3, 4], 4, 4, other, root_hash("another model"))
    assert other[0] != a[0]
    grown = a[:1]  # extending a chain continues from its last hash
    chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 8, 4, grown, ROOT)
    assert grown == a


def test_a_block_follows_its_sequence_and_runs_start_apart() -> None:
    pool = BlockPool(16, 4)
    a = [pool.allocate()]
    assert a == [0]  # nothing held before the pool's start: a run begins there
    b = [pool.allocate()]
    assert b == [8]  # a held block before the free run, too short for GAP: half way along it
    for _ in range(3):  # two sequences growing in turns each stay one run
        a.append(pool.allocate(a[-1]))
        b.append(pool.allocate(b[-1]))
    assert a == [0, 1, 2, 3] and b == [8, 9, 10, 11]
    c = pool.allocate()
    assert c == 4 + 4 // 2  # the first run with the most room, 4..7 (12..15 has as much): half way
    pool.release(a)
    pool.release([c])
    assert pool.allocate() == 0  # the held block before the run is gone: its start


def test_in_a_large_pool_runs_start_a_gap_after_the_last_running_sequence() -> None:
    """Room to grow behind each running sequence, and no further: the runs stay low in the pool,
    whose pages are then touched in order."""
    pool = BlockPool(4096, 16)

    def prompt(blocks: int) -> list[int]:
        table = [pool.allocate()]
        while len(table) < blocks:
            table.append(pool.allocate(table[-1]))
        return table

    a, b, c = prompt(57), prompt(57), prompt(57)
    assert a[0] == 0 and b[0] == 57 + BlockPool.GAP and c[0] == b[-1] + 1 + BlockPool.GAP
    assert all(t == list(range(t[0], t[0] + 57)) for t in (a, b, c))
    pool.release(a)
    assert prompt(3) == [0, 1, 2]  # nothing running before the pool's start any more


def test_a_taken_successor_starts_a_new_run_and_exhaustion_raises() -> None:
    pool = BlockPool(3, 4)
    first = pool.allocate()
    assert pool.allocate(first) == 1
    assert pool.allocate(first) == 2  # its successor is held: the only free block left
    with pytest.raises(NoFreeBlocks):
        pool.allocate()
    pool.release([1])
    assert pool.free == 1 and pool.allocate(2) == 1  # past the pool's end: a new run


def test_a_cached_successor_is_not_evicted_while_plain_blocks_are_free() -> None:
    pool = BlockPool(4, 4)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b, pool.allocate(a)) == (0, 2, 1)
    pool.register(b, hashes([1, 2, 3, 4])[0])
    pool.release([b])
    assert pool.allocate(1) == 3  # 2 holds a known prefix: the free block after it instead
    assert pool.cached_free == 1


def test_shared_blocks_are_freed_by_their_last_holder() -> None:
    pool = BlockPool(4, 4)
    h = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    blocks = [pool.allocate(), pool.allocate()]
    for block, key in zip(blocks, h, strict=True):
        pool.register(block, key)
    assert pool.match(h) == blocks
    for block in blocks:  # a second sequence shares the prefix
        pool.take(block)
    pool.release(blocks)
    assert pool.used == 2  # still held by the second
    pool.release(blocks)
    assert pool.used == 0 and pool.cached_free == 2
    assert pool.match(h) == blocks  # free, but still cached


def test_lru_evicts_the_oldest_cached_block_and_only_when_nothing_plain_is_free() -> None:
    pool = BlockPool(3, 4)
    first, second = hashes([1, 1, 1, 1]), hashes([2, 2, 2, 2])
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, first[0])
    pool.register(b, second[0])
    pool.release([a])
    pool.release([b])  # a is older in the LRU
    (plain,) = {0, 1, 2} - {a, b}
    assert pool.allocate() == plain  # a plain block before any eviction
    assert pool.allocate() == a and pool.evictions == 1
    assert pool.match(first) == [] and pool.match(second) == [b]
    pool.take(b)  # a hit takes it out of the LRU
    with pytest.raises(NoFreeBlocks):
        pool.allocate()


def test_a_sequence_tail_is_evicted_before_its_prefix() -> None:
    pool = BlockPool(3, 4)
    h = hashes(list(range(12)))
    blocks = [pool.allocate() for _ in range(3)]
    for block, key in zip(blocks, h, strict=True):
        pool.register(block, key)
    pool.release(blocks)  # released last first
    assert pool.allocate() == blocks[2]
    assert pool.match(h) == blocks[:2]


def test_a_duplicate_block_stays_plain_and_clear_forgets_everything() -> None:
    pool = BlockPool(3, 4)
    h = hashes([5, 5, 5, 5])
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, h[0])
    pool.register(b, h[0])  # computed side by side: the first stays the cached one
    pool.release([a, b])
    assert pool.match(h) == [a] and pool.cached_free == 1
    pool.clear_cache()
    assert pool.match(h) == [] and pool.free == 3 and pool.cached_free == 0


def test_the_journal_records_every_change_to_the_known_blocks() -> None:
    """What the worker publishes for cache-aware pickup: known blocks in, evicted ones out."""
    pool = BlockPool(2, 4)
    pool.journal = deque()
    first, second, third = hashes([1, 1, 1, 1]), hashes([2, 2, 2, 2]), hashes([3, 3, 3, 3])
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, first[0])
    pool.register(b, second[0])
    pool.register(b, first[0])  # a prefix computed twice side by side: the first stays known
    pool.release([a, b])  # last first: b is the older entry of the LRU
    c = pool.allocate()  # evicts it
    pool.register(c, third[0])
    assert list(pool.journal) == [
        (True, first[0]),
        (True, second[0]),
        (False, second[0]),
        (True, third[0]),
    ]
    pool.journal.clear()
    pool.clear_cache()
    assert sorted(pool.journal) == sorted([(False, first[0]), (False, third[0])])


def test_the_worker_and_the_api_hash_a_prompt_alike() -> None:
    """The queue's preference and the prefix cache key on the same chain (shared.prefix)."""
    tokens = list(range(37))
    assert prompt_chain("m", tokens, 4) == hashes(tokens)
    assert prompt_chain("other", tokens, 4)[0] != hashes(tokens)[0]
