"""Attention of single token rows over the paged KV cache, on a GPU: a Triton kernel that reads
keys and values through the block tables (no gather into contiguous tensors), and the torch
reference it is tested against.

Each row attends to positions ``0 .. positions[r]`` of the sequence whose block table is row
``seq_index[r]`` of ``tables``: a decoding sequence's next token, which is every row of a CUDA
graph's decode step. Prompt chunks take SDPA's fused kernels instead (``models/llama.py``).

The kernel is FlashDecoding: a row's keys are cut into ``splits`` ranges that separate programs
read at once, each keeping an online softmax (running maximum, sum and weighted values), and a
second kernel folds the ranges together. One stream of an 8B model has 8 KV heads, so without the
split 8 programs would walk a 1,000-token context block by block while the GPU's 132
multiprocessors idle; with it the reads spread over the chip. The split count is fixed per
launch shape (a captured graph replays the same grid), and each program finds its own range of
the row's keys at run time, so one graph serves every context length.

A group of query heads that share a KV head is one program's matrix (``G`` rows, padded to 16
for the tensor cores): keys are read once per group, as grouped-query attention intends.
"""

from __future__ import annotations

import torch

try:  # Triton ships with torch's CUDA builds; the CPU wheel has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["HAVE_TRITON", "paged_attention", "paged_attention_reference", "split_count"]

HAVE_TRITON = triton is not None
TILE = 64  # keys a program reads per iteration (several blocks' worth of memory in flight)


def split_count(rows: int, kv_heads: int, sms: int = 132) -> int:
    """How many ranges to cut each row's keys into: enough programs for two per multiprocessor,
    a power of two (each is a compiled variant) and at most 16 (more ranges cost more folding
    than they win)."""
    want = -(-2 * sms // max(1, rows * kv_heads))
    return min(16, 1 << (want - 1).bit_length())


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """What ``paged_attention`` computes, row by row in fp32: q (n, H, hd), one layer's cache
    (KV, blocks, block_size, hd), tables (S, W) -> (n, H, hd) in q's dtype."""
    n, H, hd = q.shape
    KV, _, bs, _ = k_cache.shape
    out = torch.empty_like(q)
    for r in range(n):
        length = int(positions[r]) + 1
        blocks = tables[int(seq_index[r]), : -(-length // bs)].long()
        keys = k_cache[:, blocks].reshape(KV, -1, hd)[:, :length].float()  # (KV, L, hd)
        values = v_cache[:, blocks].reshape(KV, -1, hd)[:, :length].float()
        qg = q[r].float().view(KV, H // KV, hd)
        att = torch.softmax(qg @ keys.transpose(1, 2) * scale, dim=-1)  # (KV, G, L)
        out[r] = (att @ values).view(H, hd).to(q.dtype)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """Single-row attention over the paged cache (see the module doc); shapes as the reference.

    No host synchronisation and no data-dependent shapes: safe inside a captured CUDA graph.
    """
    if triton is None:
        raise RuntimeError("paged attention on the GPU needs triton")
    n, H, hd = q.shape
    KV, _, bs, _ = k_cache.shape
    G = H // KV
    splits = splits or split_count(n, KV)
    g_pad = max(16, triton.next_power_of_2(G))
    d_pad = max(16, triton.next_power_of_2(hd))
    tile = max(TILE, bs)
    out = torch.empty_like(q)
    if splits == 1:
        part_max = part_sum = part_out = out  # unused: the kernel writes ``out`` itself
    else:
        part_max = torch.empty(n, H, splits, device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty(n, H, splits, hd, device=q.device, dtype=torch.float32)
    # fp32 models: no TF32 rounding in the products (the option is ignored for halves)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _split_kernel[(n, KV, splits)](
        q, k_cache, v_cache, tables, seq_index, positions, part_max, part_sum, part_out, out,
        scale * 1.4426950408889634,  # exp2 in the kernel: fold log2(e) into the scale
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        G=G, G_PAD=g_pad, HD=hd, D_PAD=d_pad, BS=bs, TILE=tile, SPLITS=splits,
        PRECISION=precision,
    )  # fmt: skip
    if splits > 1:
        _fold_kernel[(n, H)](
            part_max, part_sum, part_out, out, out.stride(0), out.stride(1),
            HD=hd, D_PAD=d_pad, SPLITS=splits, S_PAD=triton.next_power_of_2(splits),
        )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, seq_ptr, pos_ptr, max_ptr, sum_ptr, acc_ptr, out_ptr,
        scale, stride_qn, stride_qh, stride_kh, stride_kb, stride_kt, stride_table,
        stride_on, stride_oh,
        G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, D_PAD: tl.constexpr,
        BS: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(seq_ptr + row).to(tl.int64)
        length = tl.load(pos_ptr + row).to(tl.int32) + 1
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        t = tl.arange(0, TILE)
        g_ok = g < G
        d_ok = d < HD
        heads = kvh * G + g
        q = tl.load(
            q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        # this program's share of the row's tiles (the last ranges of a short row are empty)
        tiles = tl.cdiv(length, TILE)
        per = tl.cdiv(tiles, SPLITS)
        first = split * per
        last = tl.minimum(first + per, tiles)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        s_acc = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        table = tables_ptr + seq * stride_table
        base = kvh.to(tl.int64) * stride_kh
        for tile_i in range(first, last):
            tok = tile_i * TILE + t
            ok = tok < length
            block = tl.load(table + tok // BS, mask=ok, other=0).to(tl.int64)
            at = base + block * stride_kb + (tok % BS) * stride_kt
            kv_mask = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s = tl.where(ok[None, :], s * scale, float("-inf"))  # (G_PAD, TILE), log2 units
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            s_acc = s_acc * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m = m_new
        if SPLITS == 1:  # the whole row in this program: no partials to fold
            y = acc / s_acc[:, None]
            out_at = (
                out_ptr + row.to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :]
            )
            tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            head_rows = row.to(tl.int64) * (tl.num_programs(1) * G) + heads  # (n, H) row-major
            tl.store(max_ptr + head_rows * SPLITS + split, m, mask=g_ok)
            tl.store(sum_ptr + head_rows * SPLITS + split, s_acc, mask=g_ok)
            part_at = (head_rows[:, None] * SPLITS + split) * HD + d[None, :]
            tl.store(acc_ptr + part_at, acc, mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _fold_kernel(
        max_ptr, sum_ptr, acc_ptr, out_ptr, stride_on, stride_oh,
        HD: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        at = row.to(tl.int64) * tl.num_programs(1) + head
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        s_ok = s < SPLITS
        m = tl.load(max_ptr + at * SPLITS + s, mask=s_ok, other=float("-inf"))
        total = tl.load(sum_ptr + at * SPLITS + s, mask=s_ok, other=0.0)
        best = tl.max(m, 0)  # finite: the first range always holds position 0
        w = tl.where(s_ok & (m > float("-inf")), tl.exp2(m - best), 0.0)
        parts = tl.load(
            acc_ptr + (at * SPLITS + s[:, None]) * HD + d[None, :],
            mask=s_ok[:, None] & (d[None, :] < HD),
            other=0.0,
        )
        y = tl.sum(parts * w[:, None], 0) / tl.sum(total * w, 0)
        tl.store(out_ptr + row * stride_on + head * stride_oh + d, y, mask=d < HD)
