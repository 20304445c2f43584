"""The paged KV cache and the per-forward attention batch description.

Owns cache memory and its layout: ``[layers, kv_heads, blocks, block_size, head_dim]`` for keys
and values, one pool of fixed-size blocks shared by every sequence (``block_pool.BlockPool``
decides which block holds what). Heads are outside blocks so a head's keys in consecutive blocks
are one contiguous run, which a decode step streams through. A sequence's keys and values live
in the blocks its block table lists, position ``p`` in block ``table[p // block_size]`` at offset
``p % block_size``; sequences whose prompts share a prefix share its blocks read-only.

The pool is reserved at start-up (``torch.empty``: no page is touched until a block is first
written, so resident memory follows the blocks in use, not the reservation).

Knows nothing about models beyond shapes, nor about sampling or requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from services.worker.block_pool import BlockPool
from services.worker.host_memory import huge_empty
from services.worker.paged_attention import HAVE_TRITON

__all__ = ["AttentionBatch", "DecodeRows", "PagedKVCache", "SeqRows", "build_batch"]


@dataclass(frozen=True)
class SeqRows:
    """One sequence's share of a forward: ``count`` new tokens after ``start`` cached ones,
    written through ``table``; logits wanted for its last ``logits`` new tokens."""

    key: int  # the scheduler's id for the sequence (stable across steps)
    table: list[int]  # block ids covering positions 0 .. start + count - 1
    start: int
    count: int
    logits: int = 1


@dataclass
class AttentionBatch:
    """Where one forward's ``n`` token rows live. Rows are grouped by sequence, in order.

    Built once per forward and shared by every layer.
    """

    seqs: list[SeqRows]
    positions: torch.Tensor  # (n,) int64 absolute position of each row
    seq_index: torch.Tensor  # (n,) int64 which sequence (row of ``tables``) each row is
    tables: torch.Tensor  # (S, W) int32 block tables, padded with block 0
    logit_rows: torch.Tensor  # (m,) int64 rows whose logits the forward returns, ascending
    span: int  # the longest sequence's length after this forward (keys its attention reads)
    block_size: int
    firsts: list[int]  # the row of each sequence's first new token
    decode_only: bool = False  # every sequence has one new row (row i is sequence i)

    @cached_property
    def decoding(self) -> DecodeRows | None:
        """The sequences with one new row, gathered once per forward for torch's attention
        (which attends to them together); None when there are none."""
        single = [i for i, s in enumerate(self.seqs) if s.count == 1]
        if not single:
            return None
        rows = self.logit_rows.new_tensor([self.firsts[i] for i in single])
        span = max(self.seqs[i].start + 1 for i in single)
        keys = torch.arange(span, device=self.positions.device)
        return DecodeRows(
            rows, self.tables[single], span, keys[None, :] <= self.positions[rows, None]
        )


@dataclass(frozen=True)
class DecodeRows:
    """``AttentionBatch.decoding``: the rows, their block tables, the keys they read and which of
    those each may attend to."""

    rows: torch.Tensor  # (b,) int64
    tables: torch.Tensor  # (b, W) int32
    span: int  # keys read: the longest of them
    mask: torch.Tensor  # (b, span) bool


def build_batch(seqs: list[SeqRows], block_size: int, device: torch.device) -> AttentionBatch:
    """Describe a forward over ``seqs`` (each table long enough for its new tokens)."""
    positions: list[int] = []
    index: list[int] = []
    wanted: list[int] = []
    firsts: list[int] = []
    for i, s in enumerate(seqs):
        if s.count < 1 or s.logits > s.count or len(s.table) * block_size < s.start + s.count:
            raise ValueError(f"bad rows for a forward: {s.count} after {s.start}, {s.logits}")
        first = len(positions)
        firsts.append(first)
        positions.extend(range(s.start, s.start + s.count))
        index.extend([i] * s.count)
        wanted.extend(range(first + s.count - s.logits, first + s.count))
    width = max(len(s.table) for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.table)] = torch.tensor(s.table, dtype=torch.int32)
    return AttentionBatch(
        seqs=seqs,
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        seq_index=torch.tensor(index, dtype=torch.long, device=device),
        tables=tables.to(device),
        logit_rows=torch.tensor(wanted, dtype=torch.long, device=device),
        span=max(s.start + s.count for s in seqs),
        block_size=block_size,
        firsts=firsts,
        decode_only=len(positions) == len(seqs),
    )


class PagedKVCache:
    """Keys and values for every sequence, in ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(
        self,
        *,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = True,
    ) -> None:
        """Reserve the pool (untouched until used).

        ``zeroed``: a block is zero-filled the first time it is handed out. Torch's attention
        reads whole blocks and masks the positions past a sequence's length, and 0 x NaN from
        never-written memory would leak through the mask; a block reused later holds finite
        values. The CPU kernels read only positions they wrote and skip it.
        """
        if block_size % 8:
            raise ValueError(f"the block size must be a multiple of 8, not {block_size}")
        self.layers, self.num_blocks, self.block_size = layers, num_blocks, block_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.zeroed = zeroed
        shape = (layers, kv_heads, num_blocks, block_size, head_dim)
        if device.type == "cpu":  # on 2 MB pages: a sequence's blocks may lie anywhere in it
            self.k, self.v = huge_empty(shape, dtype), huge_empty(shape, dtype)
        else:
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self.pool = BlockPool(num_blocks, block_size)
        self._touched = [False] * num_blocks
        if zeroed and device.type == "cuda":  # one memset at start beats a launch per block
            self.k.zero_()
            self.v.zero_()
            self._touched = [True] * num_blocks
        # single-token rows attend through the block tables in a Triton kernel (GPU only)
        self.paged_kernel = device.type == "cuda" and HAVE_TRITON

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Keys and values of one token in every layer."""
        return layers * 2 * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def tokens(self) -> int:
        """The pool's capacity in tokens."""
        return self.num_blocks * self.block_size

    def extend(self, table: list[int], count: int = 1) -> list[int]:
        """Append ``count`` blocks to a sequence's block table (and return it), each the block
        after the table's last where that is free (``BlockPool.allocate``): a table built this
        way is one run, where a list of ``allocate()`` calls would start a run per block."""
        for _ in range(count):
            table.append(self.allocate(table[-1] if table else None))
        return table

    def allocate(self, after: int | None = None) -> int:
        """A block for a sequence's next tokens, after its last block ``after`` where that is free
        (``BlockPool.allocate``), zeroed on first use where the model needs it."""
        block = self.pool.allocate(after)
        if self.zeroed and not self._touched[block]:
            self.k[:, :, block].zero_()
            self.v[:, :, block].zero_()
        self._touched[block] = True
        return block

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> None:
        """Store ``k``/``v`` (n, KV, hd), one row per token, at each row's position (rounded to
        the cache's dtype where it is narrower)."""
        pos = batch.positions
        blocks = batch.tables[batch.seq_index, pos // self.block_size].long()
        offsets = pos % self.block_size
        self.k[layer][:, blocks, offsets] = k.transpose(0, 1).to(self.dtype)  # (KV, n, hd)
        self.v[layer][:, blocks, offsets] = v.transpose(0, 1).to(self.dtype)

    def read(
        self, layer: int, tables: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (S, KV, length, hd) of the sequences whose block tables are
        ``tables`` (S, W), positions 0 .. length - 1 (past a sequence's own length: masked by
        the caller). A gather: torch has no paged attention on the CPU."""
        width = -(-length // self.block_size)
        ids = tables[:, :width].long()
        S = ids.shape[0]

        def gather(cache: torch.Tensor) -> torch.Tensor:
            blocks = cache[layer][:, ids]  # (KV, S, W, BS, hd)
            blocks = blocks.transpose(0, 1).reshape(S, self.kv_heads, -1, self.head_dim)
            return blocks[:, :, :length]

        return gather(self.k), gather(self.v)
