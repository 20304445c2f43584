"""A GGUF file's quantized weights as the kernels read them, without a dense copy.

Owns ``QuantBlocks`` (one 2-D weight's raw GGUF blocks), ``FileWeights`` (what a file holds for
each weight: its type, and its blocks where a kernel reads that type) and packing weights into
the layouts ``services/worker/kernels/sluice_cpu.h`` documents: raw blocks as they are
(``pack_blocks``), dense weights re-quantized (``pack_q4_1``, ``pack_q8_0``).

A GGUF Q4_0 / Q4_1 / Q8_0 row is ``K / 32`` blocks of ``[d: f16][m: f16, Q4_1 only][values]``
(ggml's block_q4_0 etc., https://github.com/ggml-org/ggml/blob/master/src/ggml-common.h). The
kernels' layouts hold the same integers re-ordered and the scales as fp32, so packing is a byte
shuffle: exact, where re-quantizing dequantized weights is not always (a Q4_0 block that does
not reach both ends of its grid, for one). A Q4_K super-block of 256 values is eight such
affine 4-bit sub-blocks with 6-bit scales and minimums, so it packs exactly as Q4_1.
"""

from __future__ import annotations

from ctypes import sizeof
from dataclasses import dataclass, field

import torch

from services.worker.kernels import BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ8_0

__all__ = [
    "BLOCK_BYTES",
    "FOUR_BIT_TYPES",
    "KERNEL_TYPES",
    "FileWeights",
    "QuantBlocks",
    "dequantize_blocks",
    "pack_blocks",
    "pack_q4_1",
    "pack_q8_0",
    "type_name",
    "unpack_q4_1",
]

QK = 32
# GGML type ids (ggml.h GGML_TYPE_*), as sluice_cpu.h's SL_* constants number them.
Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12
QK_K = 256  # values per K-quant super-block
# A kernel reads these blocks exactly: as they are, or (Q4_K) as Q4_1 blocks with fp32 scales.
KERNEL_TYPES = frozenset({Q4_0, Q4_1, Q8_0, Q4_K})
# 4-bit (or smaller) types: a linear made of them loses little re-quantized as Q4_1.
FOUR_BIT_TYPES = frozenset({Q4_0, Q4_1, 10, 11, 12})  # and Q2_K, Q3_K, Q4_K
BLOCK_BYTES = {Q4_0: sizeof(BlockQ4_0), Q4_1: sizeof(BlockQ4_1), Q8_0: sizeof(BlockQ8_0)}
BLOCK_BYTES[Q4_K] = sizeof(BlockQ4K)  # per 256 values
_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}
_NAMES |= {10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}


def type_name(qtype: int) -> str:
    """ggml's name for a type id (``Q4_0``), or ``type <id>``."""
    return _NAMES.get(qtype, f"type {qtype}")


@dataclass
class QuantBlocks:
    """One (N, K) weight as GGUF blocks: ``data`` uint8 (N, K / 32 * block bytes), rows in the
    model's order (llama.cpp's Q/K permutation already undone: it only moves whole rows)."""

    qtype: int
    data: torch.Tensor
    shape: tuple[int, int]

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks | None:
        """The parts stacked by rows (a fused linear), or None when their types differ."""
        if len({p.qtype for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            return None
        rows = sum(p.shape[0] for p in parts)
        return QuantBlocks(
            parts[0].qtype, torch.cat([p.data for p in parts]), (rows, parts[0].shape[1])
        )


@dataclass
class FileWeights:
    """What a GGUF file holds for each 2-D weight (Hugging Face names): its GGML type, and its
    blocks where a kernel reads that type."""

    types: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, QuantBlocks] = field(default_factory=dict)

    def fused(self, names: list[str]) -> QuantBlocks | None:
        """The blocks of ``names`` stacked (one packed linear), or None when a part has no
        kernel-readable blocks or the parts' types differ."""
        parts = [self.blocks.get(n) for n in names]
        if any(p is None for p in parts):
            return None
        return QuantBlocks.cat([p for p in parts if p is not None])


def _f16(raw: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 at ``offset`` of every block of ``raw`` (N, nb, bytes) as fp32 (N, nb)."""
    return raw[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _by_group(t: torch.Tensor) -> torch.Tensor:
    """(N, nb) per-row scales -> (N/8, nb, 8): the eight interleaved rows' scales side by side."""
    n, nb = t.shape
    return t.view(n // 8, 8, nb).permute(0, 2, 1).contiguous()


def _interleave(qs: torch.Tensor) -> torch.Tensor:
    """GGUF-order nibble bytes (N, nb, 16) -> the kernel's eight-row groups (N/8, nb * 128):
    GGUF byte ``4 j + i`` of row r (value ``4 j + i`` in its low nibble, ``16 + 4 j + i`` in its
    high nibble) is the byte the kernel wants at ``32 j + 4 r + i`` of the group's block."""
    n, nb = qs.shape[0], qs.shape[1]
    grouped = qs.reshape(n // 8, 8, nb, 4, 4).permute(0, 2, 3, 1, 4)  # (G, nb, j, r, i)
    return grouped.reshape(n // 8, nb * 128).contiguous()


def _q4_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks (N, K/256, 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128
    bytes of nibbles) -> per 32 values: values (N, K/32, 32) 0..15, scale d * sc and minimum
    -dmin * m (N, K/32) fp32, so that w = scale * q + minimum: a Q4_1 block with fp32 scales."""
    n, ns = raw.shape[0], raw.shape[1]
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    s = raw[..., 4:16].to(torch.int32)  # (N, ns, 12)
    # ggml's get_scale_min_k4: sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and
    # 4..7 (mins); sub-blocks 4..7 split over bytes 8..11 and the top 2 bits of bytes 0..7.
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = raw[..., 16:].reshape(n, ns, 4, 1, 32)  # 64 values per 32 bytes: low, then high nibbles
    q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, ns * 8, QK)
    scale = (d[..., None] * sc.float()).reshape(n, ns * 8)
    low = (-dmin[..., None] * mn.float()).reshape(n, ns * 8)
    return q, scale, low


def pack_blocks(b: QuantBlocks) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Raw blocks -> the kernel format that reads them exactly, and its (values, scales,
    minimums or None).

    Q8_0: int8 (N, K) and scales (N, K/32). Q4_0 / Q4_1: eight rows interleaved (N % 8 == 0),
    the GGUF nibble bytes re-ordered (``_interleave``). Q4_K: each 32-value sub-block is
    ``(d sc) q - (dmin m)`` with q in 0..15, so it becomes a Q4_1 block with fp32 scale and
    minimum (both products exact in fp32): the Q4_1 kernel then computes what ggml does.
    """
    n, k = b.shape
    nb = k // QK
    if b.qtype == Q4_K:
        q, scale, low = _q4_k(b.data.view(n, k // QK_K, BLOCK_BYTES[Q4_K]))
        nibbles = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        return Q4_1, _interleave(nibbles), _by_group(scale), _by_group(low)
    raw = b.data.view(n, nb, BLOCK_BYTES[b.qtype])
    if b.qtype == Q8_0:
        values = raw[..., 2:].contiguous().view(torch.int8).view(n, k)
        return Q8_0, values, _f16(raw, 0).contiguous(), None
    packed = _interleave(raw[..., 2 if b.qtype == Q4_0 else 4 :])
    minimums = None if b.qtype == Q4_0 else _by_group(_f16(raw, 2))
    return b.qtype, packed, _by_group(_f16(raw, 0)), minimums


def pack_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) weights -> Q4_1 with eight rows interleaved (the layout ``sluice_cpu.h`` documents).

    Returns nibbles (N/8, K/32 * 128) uint8, scales and minimums (N/8, K/32, 8) fp32. In each
    128-byte block, byte ``32 j + 4 r + i`` holds row r's value ``4 j + i`` (low nibble) and
    value ``16 + 4 j + i`` (high nibble).
    """
    n, k = w.shape
    g, nb = n // 8, k // QK
    blocks = w.detach().float().reshape(n, nb, QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = (hi - lo) / 15.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = ((blocks - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    q = q.view(g, 8, nb, QK).permute(0, 2, 1, 3)  # (G, nb, row, 32)
    low, high = q[..., :16].reshape(g, nb, 8, 4, 4), q[..., 16:].reshape(g, nb, 8, 4, 4)
    nibbles = (low | (high << 4)).permute(0, 1, 3, 2, 4)  # (G, nb, j, row, i)

    def by_group(t: torch.Tensor) -> torch.Tensor:
        return t.view(g, 8, nb).permute(0, 2, 1).contiguous()  # (G, nb, row)

    return nibbles.reshape(g, nb * 128).contiguous(), by_group(scale), by_group(lo)


def unpack_q4_1(nibbles: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The (N, K) weights that ``pack_q4_1``'s output encodes (its inverse on the 4-bit grid)."""
    g, nb = scale.shape[0], scale.shape[1]
    b = nibbles.view(g, nb, 4, 8, 4).permute(0, 1, 3, 2, 4)  # (G, nb, row, j, i)
    q = torch.cat([(b & 0x0F).reshape(g, nb, 8, 16), (b >> 4).reshape(g, nb, 8, 16)], -1)
    w = q.float() * scale[..., None] + low[..., None]  # (G, nb, row, 32)
    return w.permute(0, 2, 1, 3).reshape(g * 8, nb * QK)


def pack_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weights -> int8 values (N, K) and one scale per 32 (N, K/32) fp32."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // QK, QK)
    scale = blocks.abs().amax(-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scale.contiguous()


def dequantize_blocks(b: QuantBlocks) -> torch.Tensor:
    """The (N, K) fp32 weights the blocks encode (the reference the packing tests compare to)."""
    n, k = b.shape
    if b.qtype == Q4_K:
        q, scale, low = _q4_k(b.data.view(n, k // QK_K, BLOCK_BYTES[Q4_K]))
        return (q.float() * scale[..., None] + low[..., None]).view(n, k)
    raw = b.data.view(n, k // QK, BLOCK_BYTES[b.qtype])
    d = _f16(raw, 0)[..., None]
    if b.qtype == Q8_0:
        return (d * raw[..., 2:].contiguous().view(torch.int8).float()).view(n, k)
    qs = raw[..., 2 if b.qtype == Q4_0 else 4 :]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
    if b.qtype == Q4_0:
        return (d * (q - 8.0)).view(n, k)
    return (d * q + _f16(raw, 2)[..., None]).view(n, k)
