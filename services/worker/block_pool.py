"""The KV cache's blocks: allocation, reference counts and the prefix cache across requests.

Owns which of the pool's fixed-size blocks are free, which running sequences hold each block,
and which full blocks are known by content. Knows nothing about tensors, models or requests:
the scheduler asks for blocks and hands them back; ``kv_cache.PagedKVCache`` owns the memory.

A full block is known by its hash in the prompt's chain (``shared/prefix.py``, shared with the
API, which computes the same chain for the queue's cache-aware pickup): equal hashes mean equal
whole prefixes, and a block's keys and values depend only on that prefix (the kernels compute a
token's key, value and logits to the same bits whatever batch, chunk or thread count computed
them).

A block whose last holder releases it stays cached: it moves to an LRU of free-but-cached
blocks, from which a later prompt with the same prefix takes it back, and from which allocation
evicts the oldest only when no plain free block is left. Plain free blocks are handed out lowest
index first, so memory that was ever touched is reused before fresh pages are.

With a ``journal`` set, every change to the set of known blocks is appended to it as
``(known, hash)``: the worker publishes from it which prefixes it holds, so the queue can send a
prompt to the worker that holds most of it (``services/queue/affinity.py``). The decode thread
appends and the event loop drains; a deque's appends and pops are thread-safe.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque

from shared.prefix import chain_hashes, root_hash

__all__ = ["BlockPool", "NoFreeBlocks", "chain_hashes", "root_hash"]


class NoFreeBlocks(RuntimeError):
    """Every block is held by a running sequence."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens with reference counts and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a pool needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}  # full blocks known by content (held or in the LRU)
        self._plain = list(range(num_blocks))  # a min-heap of free blocks holding nothing known
        self._lru: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        self.evictions = 0  # cached blocks reused for other content
        self.journal: deque[tuple[bool, bytes]] | None = None  # (known?, hash) per change

    @property
    def free(self) -> int:
        """Blocks an allocation can take now (plain free ones and evictable cached ones)."""
        return len(self._plain) + len(self._lru)

    @property
    def cached_free(self) -> int:
        """Free blocks that still hold a known prefix."""
        return len(self._lru)

    @property
    def used(self) -> int:
        """Blocks held by at least one running sequence."""
        return self.num_blocks - self.free

    def allocate(self) -> int:
        """A block for new keys and values, held once by the caller.

        Raises:
            NoFreeBlocks: every block is held.
        """
        if self._plain:
            block = heapq.heappop(self._plain)
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            known = self.hash_of[block]
            if known is not None and self.by_hash.get(known) == block:
                del self.by_hash[known]
                if self.journal is not None:
                    self.journal.append((False, known))
            self.hash_of[block] = None
            self.evictions += 1
        else:
            raise NoFreeBlocks("every KV block is held by a running sequence")
        self.refs[block] = 1
        return block

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (not yet held: ``take`` them)."""
        found: list[int] = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def take(self, block: int) -> None:
        """Hold a cached block once more (a prefix hit): it leaves the LRU if it was free."""
        if self.refs[block] == 0:
            del self._lru[block]
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Give back one hold on each of ``blocks``, last first: a sequence's tail blocks are then
        the older entries in the LRU, evicted before the prefix they extend."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            if self.hash_of[block] is not None:
                self._lru[block] = None
            else:
                heapq.heappush(self._plain, block)

    def register(self, block: int, h: bytes) -> None:
        """Make a held block that just filled known by its chain hash ``h``. If another block
        already holds that prefix (two sequences computed it side by side), the first stays the
        cached one and this one stays plain."""
        if h not in self.by_hash:
            self.by_hash[h] = block
            self.hash_of[block] = h
            if self.journal is not None:
                self.journal.append((True, h))

    def clear_cache(self) -> None:
        """Forget every cached prefix (free cached blocks become plain free blocks)."""
        for block in self._lru:
            heapq.heappush(self._plain, block)
        self._lru.clear()
        if self.journal is not None:
            self.journal.extend((False, h) for h in self.by_hash)
        self.by_hash.clear()
        self.hash_of = [None] * self.num_blocks
