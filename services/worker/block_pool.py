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
evicts the oldest only when no plain free block is left.

Where a block lies matters on a CPU: the kernels stream a sequence's blocks one after another
for every layer and kv head, and blocks that follow each other in memory let the hardware
prefetcher run ahead. On a Zen 4 EPYC, four streams whose blocks were taken in turns (lowest
free index first, as this pool used to hand them out) made a four-row step after 900 tokens
37 % slower than the same rows on runs of blocks (11.45 against 8.34 ms; on a 2-core AVX2 Zen 3
EPYC 34.6 against 23.2 ms, and with five rows each 78.2 against 67.3). So a sequence's next
block is the one after its last when that is plain free, and a block that starts a run (a
sequence's first, or its next when the following block is taken) leaves room behind the
running sequence before it (``_run_start``). The runs stay low in the pool, so the memory
touched stays compact: on the CPU the pool lies on 2 MB pages, each holding 1,024 of the default
model's blocks of one layer and kv head, and a run started half way along a large pool would
make another such page resident in every layer.

With a ``journal`` set, every change to the set of known blocks is appended to it as
``(known, hash)``: the worker publishes from it which prefixes it holds, so the queue can send a
prompt to the worker that holds most of it (``services/queue/affinity.py``). The decode thread
appends and the event loop drains; a deque's appends and pops are thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from shared.prefix import chain_hashes, root_hash

__all__ = ["BlockPool", "NoFreeBlocks", "chain_hashes", "root_hash"]


class NoFreeBlocks(RuntimeError):
    """Every block is held by a running sequence."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens with reference counts and a prefix cache."""

    # Blocks left free after a running sequence's last when another starts a run behind it:
    # 1,024 tokens of 16-token blocks to grow into before it must start a new run of its own.
    GAP = 64

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a pool needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = np.zeros(num_blocks, dtype=np.int32)  # holders of each block
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}  # full blocks known by content (held or in the LRU)
        self._plain = np.ones(num_blocks, dtype=np.bool_)  # free blocks holding nothing known
        self._plain_count = num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        self.evictions = 0  # cached blocks reused for other content
        self.journal: deque[tuple[bool, bytes]] | None = None  # (known?, hash) per change

    @property
    def free(self) -> int:
        """Blocks an allocation can take now (plain free ones and evictable cached ones)."""
        return self._plain_count + len(self._lru)

    @property
    def cached_free(self) -> int:
        """Free blocks that still hold a known prefix."""
        return len(self._lru)

    @property
    def used(self) -> int:
        """Blocks held by at least one running sequence."""
        return self.num_blocks - self.free

    def allocate(self, after: int | None = None) -> int:
        """A block for new keys and values, held once by the caller: the block following
        ``after`` (the caller's last block) if it is plain free, else the start of a new run.

        Raises:
            NoFreeBlocks: every block is held.
        """
        if self._plain_count:
            nxt = -1 if after is None else after + 1
            block = nxt if 0 <= nxt < self.num_blocks and self._plain[nxt] else self._run_start()
            self._plain[block] = False
            self._plain_count -= 1
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

    def _run_start(self) -> int:
        """Where a new run of blocks begins, in a run of plain free blocks: at its start when no
        running sequence holds the block before it, else ``GAP`` blocks in (at most half way),
        which leaves that sequence room to grow. The first run with room for ``GAP`` blocks
        from there keeps memory compact (the KV pool's huge pages are touched in order); in a
        pool too full for that, the run with the most room. A scan of the pool, once per run
        rather than per block: 20 us over 2,000 blocks, 0.5 ms over 340,000 (a GPU's pool)."""
        edges = np.flatnonzero(np.diff(self._plain, prepend=False, append=False))
        starts, ends = edges[0::2], edges[1::2]  # each run is [start, end)
        held = (starts > 0) & (self.refs[np.maximum(starts - 1, 0)] > 0)
        offsets = np.where(held, np.minimum(self.GAP, (ends - starts) // 2), 0)
        room = ends - starts - offsets
        i = int(np.argmax(room >= min(self.GAP, int(room.max()))))
        return int(starts[i] + offsets[i])

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
                self._plain[block] = True
                self._plain_count += 1

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
            self._plain[block] = True
        self._plain_count += len(self._lru)
        self._lru.clear()
        if self.journal is not None:
            self.journal.extend((False, h) for h in self.by_hash)
        self.by_hash.clear()
        self.hash_of = [None] * self.num_blocks
