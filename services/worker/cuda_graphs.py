"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python the
GPU waits on the host (about 20 ms a step for SmolLM2-135M, whatever the batch). A graph records
the step's launches once and replays them with one call. Shapes are frozen at capture, so:

- a step of ``n`` sequences runs the graph of the smallest bucket ``b >= n`` (1, 2, 4, 8, 16,
  32, 64, 128, 256, and the worker's ``max_batch``), its last ``b - n`` rows padding: token 0
  at position 0 of a block the graphs hold for themselves, whose writes nobody reads;
- inputs live in static device buffers that each step fills (token ids, positions, block
  tables); the output is the graph's own logits buffer, read before the next replay;
- everything inside the step is free of host synchronisation and data-dependent shapes
  (``paged_attention``'s grid is fixed per bucket; it finds each row's keys at run time).

Prompt chunks and mixed steps run eagerly: their shapes vary with every prompt, and a step that
reads hundreds of prompt tokens is long enough that launches do not matter.

On a device without graphs (the CPU, or ``SLUICE_CUDA_GRAPHS=0``) ``run`` pads the same way and
calls the model eagerly, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.kv_cache import AttentionBatch, PagedKVCache, SeqRows, build_batch

__all__ = ["BUCKETS", "DecodeGraphs", "bucket_for", "buckets_up_to"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

Forward = Callable[[torch.Tensor, AttentionBatch, PagedKVCache], torch.Tensor]


def buckets_up_to(max_batch: int) -> list[int]:
    """The ladder's buckets below ``max_batch``, then ``max_batch`` itself."""
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``n`` rows (None: more rows than the largest)."""
    return next((b for b in buckets if b >= n), None)


class DecodeGraphs:
    """Captured decode steps over one model and paged cache."""

    def __init__(
        self, model: Forward, cache: PagedKVCache, *, max_batch: int, max_blocks: int
    ) -> None:
        """Reserve the static buffers and a padding block; ``capture`` records the graphs.

        ``max_blocks``: the longest block table a sequence can have (the context, or the whole
        pool when that is smaller)."""
        self.model, self.cache = model, cache
        self.buckets = buckets_up_to(max_batch)
        self.device = cache.device
        self.pad_block = cache.allocate()  # held for good: padding rows write here
        top, dev = self.buckets[-1], cache.device
        self.ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.seq_index = torch.arange(top, dtype=torch.long, device=dev)
        self.tables = torch.full((top, max_blocks), self.pad_block, dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        # host staging, pinned so the copies to the device do not wait on the host
        self._ids = torch.zeros(top, dtype=torch.long, pin_memory=pin)
        self._positions = torch.zeros(top, dtype=torch.long, pin_memory=pin)
        self._tables = torch.zeros((top, max_blocks), dtype=torch.int32, pin_memory=pin)
        # the block table each host row holds (a copy; None: padding or unknown): a row keeps
        # its sequence from step to step, whose table grows once in block_size tokens
        self._staged: list[list[int] | None] = [None] * top
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_rows(self) -> int:
        """The most sequences one captured step holds."""
        return self.buckets[-1]

    def _batch(self, b: int) -> AttentionBatch:
        """The static buffers' first ``b`` rows as one decode-only forward."""
        pad = SeqRows(-1, [self.pad_block], 0, 1)
        return AttentionBatch(
            seqs=[pad] * b,  # placeholders: the paged kernel reads the tensors only
            positions=self.positions[:b],
            seq_index=self.seq_index[:b],
            tables=self.tables[:b],
            logit_rows=self.seq_index[:b],
            span=1,
            block_size=self.cache.block_size,
            firsts=list(range(b)),
            decode_only=True,
        )

    def capture(self) -> None:
        """Record one graph per bucket, largest first so the smaller ones reuse its memory."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        self._tables.fill_(self.pad_block)
        self._staged = [None] * len(self._staged)
        self.tables.fill_(self.pad_block)
        self.positions.zero_()
        self.ids.zero_()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            batch = self._batch(b)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile and warm the kernels outside the capture
                for _ in range(2):
                    self.model(self.ids[:b], batch, self.cache)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(self.ids[:b], batch, self.cache)
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize()

    def run(self, ids: list[int], spans: list[SeqRows]) -> torch.Tensor:
        """Logits (n, V) of one decode step: ``spans`` each one token (``ids``) after its
        cached ones. Replayed when captured, else eager over the same padded rows."""
        n = len(spans)
        b = bucket_for(n, self.buckets)
        if b is None:
            raise ValueError(f"{n} sequences exceed the largest captured batch {self.max_rows}")
        if b not in self.graphs:
            pad = SeqRows(-1, [self.pad_block], 0, 1)
            batch = build_batch([*spans, *[pad] * (b - n)], self.cache.block_size, self.device)
            idx = torch.tensor([*ids, *[0] * (b - n)], dtype=torch.long, device=self.device)
            return self.model(idx, batch, self.cache)[:n]
        width = self.stage(ids, spans, b)
        self.ids[:b].copy_(self._ids[:b], non_blocking=True)
        self.positions[:b].copy_(self._positions[:b], non_blocking=True)
        self.tables[:b, :width].copy_(self._tables[:b, :width], non_blocking=True)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]

    def stage(self, ids: list[int], spans: list[SeqRows], b: int) -> int:
        """Fill the host buffers' first ``b`` rows for a step of ``spans`` (one token each),
        the rest padding; returns the widest table's length.

        A block table is rewritten only where it differs from what its row holds: at 256
        streams of ~1,150-token contexts, writing every table's ~70 Python ints into the buffer
        took about 0.48 ms of host time a step on this repository's CI machine kind, and
        comparing each with its row's copy (a list comparison in C), rewriting the one in 16
        that gained a block, about 0.12 ms (``ops/bench/graph_staging.py``); on an H200 host
        the step's host part at 256 streams fell from 2.5 to 1.0-1.6 ms (SmolLM2's shape,
        1.22-1.40x its tok/s). A row's entries past its table's length may be stale:
        attention reads a sequence's blocks only up to its length."""
        n = len(spans)
        host_ids, host_pos, host_tab = (
            self._ids.numpy(),
            self._positions.numpy(),
            self._tables.numpy(),
        )
        staged = self._staged
        host_ids[:n] = ids
        host_ids[n:b] = 0
        host_pos[:b] = 0
        host_tab[n:b, 0] = self.pad_block
        staged[n:b] = [None] * (b - n)
        width = 1
        for i, s in enumerate(spans):
            host_pos[i] = s.start
            table = s.table
            width = max(width, len(table))
            if staged[i] != table:
                host_tab[i, : len(table)] = table
                staged[i] = list(table)  # the sequence's own list grows and shrinks in place
        return width
