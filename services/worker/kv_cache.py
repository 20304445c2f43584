"""The static per-slot KV cache and the per-forward attention batch description.

Owns cache memory and its layout: ``[layers, slots, kv_heads, capacity, head_dim]`` for keys and
values, one slot per running sequence, each slot with its own length (ragged batches). Capacity
grows by doubling up to the context length, so memory follows the longest live sequence rather
than ``slots x context``. It also remembers which tokens each slot holds after its sequence ends,
so a new prompt sharing a prefix reuses them (prefix caching within a worker).

Knows nothing about models beyond shapes, nor about sampling or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionBatch", "KVCache", "build_batch", "common_prefix"]


@dataclass
class AttentionBatch:
    """Where one forward's tokens live: B rows, each writing T tokens into a slot at ``starts``.

    Built once per forward and shared by every layer.
    """

    slots: list[int]  # cache slot of each row
    starts: list[int]  # cached length of each slot before this forward
    t: int  # new tokens per row
    positions: torch.Tensor  # (B, T) absolute positions
    mask: torch.Tensor  # (B, 1, T, S) bool, True = may attend
    span: int  # S: keys read per row (max over rows of start + T)
    slot_index: torch.Tensor  # (B,) long
    start_index: torch.Tensor  # (B,) long
    contiguous: bool  # slots are first..first+B-1: read a view instead of gathering
    causal: bool  # nothing cached before: a plain causal mask (lets SDPA use fused kernels)


def build_batch(
    slots: list[int], starts: list[int], t: int, device: torch.device
) -> AttentionBatch:
    """Describe a forward of ``t`` new tokens for each (slot, start) row.

    Args:
        slots: cache slot per row.
        starts: tokens already cached in that slot.
        t: new tokens per row (rows of a multi-token forward must share ``t``).
        device: where the index tensors live.

    Returns:
        The batch with positions and a causal, ragged-length mask.
    """
    start_index = torch.tensor(starts, dtype=torch.long, device=device)
    positions = start_index[:, None] + torch.arange(t, device=device)[None, :]  # (B, T)
    span = max(starts) + t
    keys = torch.arange(span, device=device)  # (S,)
    mask = keys[None, None, :] <= positions[:, :, None]  # (B, T, S)
    contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
    return AttentionBatch(
        slots=slots,
        starts=starts,
        t=t,
        positions=positions,
        mask=mask.unsqueeze(1),
        span=span,
        slot_index=torch.tensor(slots, dtype=torch.long, device=device),
        start_index=start_index,
        contiguous=contiguous,
        causal=max(starts) == 0,
    )


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVCache:
    """Keys and values for ``slots`` sequences, growing in capacity up to ``max_len`` tokens."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial: int = 256,
        zeroed: bool = True,
    ) -> None:
        """Allocate an empty cache of ``min(initial, max_len)`` tokens per slot.

        ``zeroed=False`` for a model whose attention reads only the positions it wrote (the CPU
        kernels, attention.c): growth then neither fills the new capacity nor touches its
        pages, so memory grows with the tokens actually cached (all slots' new capacity was
        zero-filled at each doubling: a stall, and the whole reservation resident). Torch's
        attention reads a span past shorter rows and masks it, and 0 x NaN from uninitialized
        memory would leak through the mask: it keeps zeros."""
        self.zeroed = zeroed
        self.layers, self.slots, self.max_len = layers, slots, max_len
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.capacity = 0
        self.k = torch.empty(0)
        self.v = torch.empty(0)
        self.lengths = [0] * slots
        self.tokens: list[list[int]] = [[] for _ in range(slots)]  # what each slot's KV encodes
        self._grow(min(initial, max_len))

    def _grow(self, capacity: int) -> None:
        shape = (self.layers, self.slots, self.kv_heads, capacity, self.head_dim)
        make = torch.zeros if self.zeroed else torch.empty
        k = make(shape, dtype=self.dtype, device=self.device)
        v = make(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            k[:, :, :, : self.capacity] = self.k
            v[:, :, :, : self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, capacity

    def reserve(self, length: int) -> None:
        """Make room for ``length`` tokens in every slot (doubling, capped at ``max_len``)."""
        if length > self.max_len:
            raise ValueError(f"{length} tokens exceed the cache limit of {self.max_len}")
        if length > self.capacity:
            cap = self.capacity
            while cap < length:
                cap *= 2
            self._grow(min(cap, self.max_len))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> None:
        """Store ``k``/``v`` (B, KV, T, hd) for each row at its slot's next positions (rounded to
        the cache's dtype where it is narrower)."""
        k, v = k.to(self.dtype), v.to(self.dtype)
        if batch.t == 1:
            # One token per row: a single scatter for the whole batch.
            self.k[layer, batch.slot_index, :, batch.start_index] = k[:, :, 0]
            self.v[layer, batch.slot_index, :, batch.start_index] = v[:, :, 0]
            return
        for row, (slot, start) in enumerate(zip(batch.slots, batch.starts, strict=True)):
            self.k[layer, slot, :, start : start + batch.t] = k[row]
            self.v[layer, slot, :, start : start + batch.t] = v[row]

    def read(self, layer: int, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, KV, S, hd) for each row's slot, S = ``batch.span``."""
        if batch.contiguous:
            first = batch.slots[0]
            rows = slice(first, first + len(batch.slots))
            return self.k[layer, rows, :, : batch.span], self.v[layer, rows, :, : batch.span]
        return (
            self.k[layer, batch.slot_index, :, : batch.span],
            self.v[layer, batch.slot_index, :, : batch.span],
        )
