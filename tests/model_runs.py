"""Running a model outside the engine, for model and kernel tests: a paged KV cache shaped for
it, rows for a forward, fixed slots over block tables, and a whole-prompt forward's logits.

``tests.worker_models`` makes the tiny models; this runs them.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.kv_cache import PagedKVCache, SeqRows, build_batch

__all__ = ["CPU", "Slots", "model_cache", "prefill_logits", "rows_for"]

CPU = torch.device("cpu")


def model_cache(
    model: nn.Module,
    *,
    blocks: int = 64,
    block_size: int = 16,
    dtype: torch.dtype | None = None,
    device: torch.device = CPU,
) -> PagedKVCache:
    """An empty paged KV cache shaped for ``model`` (a ``LlamaModel`` or anything with its
    config), of the model's ``kv_dtype`` (fp32 where it names none) unless ``dtype`` is given."""
    c = model.config
    dtype = dtype or getattr(model, "kv_dtype", torch.float32)
    return PagedKVCache(
        layers=c.num_layers,
        num_blocks=blocks,
        block_size=block_size,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=dtype,
        device=device,
    )


def rows_for(
    cache: PagedKVCache, table: list[int], start: int, count: int, logits: int = 1, key: int = 0
) -> SeqRows:
    """``SeqRows`` for ``count`` tokens after ``start``, allocating blocks onto ``table``."""
    while len(table) * cache.block_size < start + count:
        cache.extend(table)
    return SeqRows(key, list(table), start, count, logits)


class Slots:
    """Sequences by slot number over a paged cache, for tests written against fixed slots:
    slot ``s`` keeps its own block table, allocated as its tokens need blocks."""

    def __init__(self, cache: PagedKVCache, slots: int) -> None:
        self.cache = cache
        self.tables: list[list[int]] = [[] for _ in range(slots)]

    def forward(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        slots: list[int],
        starts: list[int],
        n_logits: int = 1,
    ) -> torch.Tensor:
        """Run ``ids`` (B, T): row b is T tokens of slot ``slots[b]`` after ``starts[b]``;
        logits (B, n_logits, V) of each row's last ``n_logits`` tokens."""
        B, T = ids.shape
        seqs = [
            rows_for(self.cache, self.tables[slot], start, T, n_logits, key=slot)
            for slot, start in zip(slots, starts, strict=True)
        ]
        batch = build_batch(seqs, self.cache.block_size, ids.device)
        return model(ids.reshape(-1), batch, self.cache).view(B, n_logits, -1)

    def kv(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s keys and values (layers, KV, length, hd), gathered from its blocks."""
        ids = torch.tensor(self.tables[slot], dtype=torch.long)

        def gather(c: torch.Tensor) -> torch.Tensor:
            blocks = c[:, :, ids]  # (L, KV, W, BS, hd)
            L, KV, W, BS, hd = blocks.shape
            return blocks.reshape(L, KV, W * BS, hd)[:, :, :length]

        return gather(self.cache.k), gather(self.cache.v)


def prefill_logits(
    model: nn.Module,
    ids: list[int],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device = CPU,
    cache: PagedKVCache | None = None,
) -> torch.Tensor:
    """Logits (T, V) at every position of one full-sequence forward (on a new cache of
    ``dtype``, by default the model's, unless ``cache`` is given)."""
    cache = cache or model_cache(model, dtype=dtype, device=device, blocks=len(ids) // 16 + 1)
    spans = [rows_for(cache, [], 0, len(ids), logits=len(ids))]
    batch = build_batch(spans, cache.block_size, device)
    with torch.inference_mode():
        return model(torch.tensor(ids, device=device), batch, cache)
