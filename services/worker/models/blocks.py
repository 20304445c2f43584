"""A GGUF file's quantized weights as the kernels read them, without a dense copy.

Owns ``QuantBlocks`` (one 2-D weight's raw GGUF blocks), ``FileWeights`` (what a file holds for
each weight: its type, and its blocks where a kernel reads that type) and packing weights into
the layouts ``services/worker/kernels/sluice_cpu.h`` documents: raw blocks as they are
(``pack_blocks``; dense weights re-quantized: ``requantize.py``).

A GGUF Q4_0 / Q4_1 / Q8_0 row is ``K / 32`` blocks of ``[d: f16][m: f16, Q4_1 only][values]``
(ggml's block_q4_0 etc., https://github.com/ggml-org/ggml/blob/master/src/ggml-common.h). The
kernels' layouts hold the same integers re-ordered and the scales as fp32, so packing is a byte
shuffle: exact, where re-quantizing dequantized weights is not always (a Q4_0 block that does
not reach both ends of its grid, for one). A Q4_K super-block of 256 values is eight such
affine 4-bit sub-blocks with 6-bit scales and minimums, so it packs exactly as Q4_1; the 5- and
6-bit types pack exactly into sluice's int8 layouts (Q8_0, Q8_M, Q8_16), and where the rows
come in groups of eight the 5-bit ones then into Q5_M (``pack_q5_m``: nibbles plus a plane of
fifth bits, 7 bits a weight with the fp32 scale and minimum against Q8_M's 10): every value as
ggml computes it.
"""

from __future__ import annotations

from ctypes import sizeof
from dataclasses import dataclass, field

import torch

from services.worker.kernels.abi import (
    BlockQ4_0,
    BlockQ4_1,
    BlockQ4K,
    BlockQ5_0,
    BlockQ5_1,
    BlockQ5K,
    BlockQ6K,
    BlockQ8_0,
)

__all__ = [
    "BLOCK_BYTES",
    "FOUR_BIT_TYPES",
    "H16",
    "HALF_LAYOUTS",
    "INTERLEAVED",
    "KERNEL_TYPES",
    "MIXED",
    "Q5_M",
    "X8",
    "FileWeights",
    "QuantBlocks",
    "as_halves",
    "by_group",
    "dequantize_blocks",
    "finite",
    "interleave_nibbles",
    "interleave_q8",
    "pack_blocks",
    "pack_q5_m",
    "type_name",
]

QK = 32
# GGML type ids (ggml.h GGML_TYPE_*), as sluice_cpu.h's SL_* constants number them.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
Q8_M, Q8_16 = 64, 65  # sluice's int8 layouts (sluice_cpu.h SL_Q8_M, SL_Q8_16)
Q5_M = 66  # Q8_M's values in five bits, eight rows interleaved (SL_Q5_M)
X8 = 256  # flag on an int8 format: eight rows interleaved (SL_X8)
H16 = 512  # flag: the scales and minimums are IEEE halves (SL_H16)
# the layouts whose kernels read halves (the interleaved ones)
HALF_LAYOUTS = frozenset({Q4_0, Q4_1, Q5_M, Q8_0 | X8})
MIXED = -1  # QuantBlocks.qtype of a fused weight whose parts differ in type (see cat)
QK_K = 256  # values per K-quant super-block
# A kernel reads these blocks exactly: as they are, or re-laid out (pack_blocks).
KERNEL_TYPES = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K})
# 4-bit (or smaller) types: a linear made of them loses little re-quantized as Q4_1.
FOUR_BIT_TYPES = frozenset({Q4_0, Q4_1, 10, 11, Q4_K})  # and Q2_K, Q3_K
INTERLEAVED = frozenset({Q4_0, Q4_1, Q4_K})  # packed in groups of eight rows (N % 8 == 0)
BLOCK_BYTES = {Q4_0: sizeof(BlockQ4_0), Q4_1: sizeof(BlockQ4_1), Q8_0: sizeof(BlockQ8_0)}
BLOCK_BYTES |= {Q5_0: sizeof(BlockQ5_0), Q5_1: sizeof(BlockQ5_1)}
BLOCK_BYTES |= {Q4_K: sizeof(BlockQ4K), Q5_K: sizeof(BlockQ5K), Q6_K: sizeof(BlockQ6K)}  # per 256
# Where each type keeps its f16 scales (and minimums) in a block: the only fields that can hold a
# NaN or an infinity (the rest are small integers).
HALVES = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2)}
HALVES |= {Q5_K: (0, 2), Q6_K: (208,)}
_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}
_NAMES |= {10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
_NAMES |= {Q8_M: "Q8_M", Q8_16: "Q8_16", Q5_M: "Q5_M"}


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
    parts: list[QuantBlocks] = field(default_factory=list)  # MIXED: the parts, by rows

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks | None:
        """The parts stacked by rows (a fused linear). Parts of different types: a MIXED weight
        when one int8 kernel format holds every part exactly (``_common_format``), else None."""
        if len({p.shape[1] for p in parts}) != 1:
            return None
        rows, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
        if len({p.qtype for p in parts}) != 1:
            ok = _common_format({p.qtype for p in parts}) is not None
            return QuantBlocks(MIXED, torch.empty(0), (rows, k), parts) if ok else None
        return QuantBlocks(parts[0].qtype, torch.cat([p.data for p in parts]), (rows, k))


def finite(b: QuantBlocks) -> bool:
    """Whether every weight the blocks encode is finite (their f16 halves are)."""
    raw = b.data.view(-1, BLOCK_BYTES[b.qtype])
    return all(bool(torch.isfinite(_f16(raw, at)).all()) for at in HALVES[b.qtype])


@dataclass
class FileWeights:
    """What a GGUF file holds for each 2-D weight (Hugging Face names): its GGML type, and its
    blocks where a kernel reads that type."""

    types: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, QuantBlocks] = field(default_factory=dict)
    lazy: bool = False  # weights with blocks were loaded as meta placeholders, not dense

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


def as_halves(
    scales: torch.Tensor, minimums: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Scales and minimums as IEEE halves where every one of them is exactly a half (those a
    GGUF block stores as its own f16 fields, and Q5_0's -16 d), else None (the K-quants' products
    of an f16 and a 6-bit scale, weights re-quantized from floats): half the bytes, which one
    stream's decode reads every token, and the same values."""
    parts = [scales] if minimums is None else [scales, minimums]
    halves = [p.half() for p in parts]
    if not all(torch.equal(h.float(), p) for h, p in zip(halves, parts, strict=True)):
        return None
    return halves[0], halves[1] if minimums is not None else None


def by_group(t: torch.Tensor) -> torch.Tensor:
    """(N, nb) per-row scales -> (N/8, nb, 8): the eight interleaved rows' scales side by side."""
    n, nb = t.shape
    return t.view(n // 8, 8, nb).permute(0, 2, 1).contiguous()


def interleave_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGUF-order nibble bytes (N, nb, 16) -> the kernel's eight-row groups (N/8, nb * 128):
    GGUF byte ``4 j + i`` of row r (value ``4 j + i`` in its low nibble, ``16 + 4 j + i`` in its
    high nibble) is the byte the kernel wants at ``32 j + 4 r + i`` of the group's block."""
    n, nb = qs.shape[0], qs.shape[1]
    grouped = qs.reshape(n // 8, 8, nb, 4, 4).permute(0, 2, 3, 1, 4)  # (G, nb, j, r, i)
    return grouped.reshape(n // 8, nb * 128).contiguous()


def _scale_min(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 bytes at offset 4 of each super-block -> eight 6-bit scales and mins.

    ggml's get_scale_min_k4: sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and 4..7
    (mins); sub-blocks 4..7 split over bytes 8..11 and the top 2 bits of bytes 0..7."""
    s = raw[..., 4:16].to(torch.int32)  # (N, ns, 12)
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.float(), mn.float()


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (..., n) -> their bits (..., 8 n), least significant first (bit i of the LE word)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & 1).flatten(-2)


Decoded = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _decode(b: QuantBlocks) -> Decoded:
    """Every kernel-readable type except Q4_0 / Q4_1 / Q8_0 (packed from their bytes) -> the
    kernel format that holds it exactly, values (N, K / 32, 32) as integers, scales per 32 (per
    16 for Q6_K) and minimums per 32 or None, in fp32: w = scale * q + minimum.

    Each scale is a product of an f16 and an integer of at most 8 bits: exact in fp32, as ggml
    computes it."""
    n, k = b.shape
    nb, ns = k // QK, k // QK_K
    if b.qtype in (Q5_0, Q5_1):  # [d][m: Q5_1 only][32 fifth bits][16 bytes of nibbles]
        raw = b.data.view(n, nb, BLOCK_BYTES[b.qtype])
        at = 2 if b.qtype == Q5_0 else 4
        qs = raw[..., at + 4 :]
        q = torch.cat([qs & 0x0F, qs >> 4], -1) | (_bits(raw[..., at : at + 4]) << 4)
        d = _f16(raw, 0)
        # Q5_0: w = d (q - 16) = d q + (-16 d), exact in fp32 (an f16 times a power of two). As
        # Q8_M the values stay unsigned (0..31), which the AVX2 kernel multiplies directly.
        return Q8_M, q, d, -16.0 * d if b.qtype == Q5_0 else _f16(raw, 2)
    raw = b.data.view(n, ns, BLOCK_BYTES[b.qtype])
    if b.qtype == Q6_K:  # [ql: 128][qh: 64][scales: 16 int8][d]
        ql, qh = raw[..., :128].view(n, ns, 2, 2, 32), raw[..., 128:192].view(n, ns, 2, 1, 32)
        # per 128 values: 32-value quarters from the low / high nibbles of ql's two halves,
        # with two high bits each from qh at shifts 0, 2, 4, 6
        low4 = torch.cat([ql & 0x0F, ql >> 4], 3)  # (N, ns, 2, 4, 32): quarters 0, 1, 2, 3
        high2 = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
        q = (low4 | (high2 << 4)).to(torch.int16) - 32
        sc = raw[..., 192:208].contiguous().view(torch.int8).float()  # (N, ns, 16)
        scale = (_f16(raw, 208)[..., None] * sc).reshape(n, 2 * nb)
        return Q8_16, q.reshape(n, nb, QK), scale, None
    sc, mn = _scale_min(raw)
    scale = (_f16(raw, 0)[..., None] * sc).reshape(n, nb)
    low = (-_f16(raw, 2)[..., None] * mn).reshape(n, nb)
    if b.qtype == Q4_K:  # [d][dmin][scales][128 bytes: per 64 values, low then high nibbles]
        qs = raw[..., 16:].reshape(n, ns, 4, 1, 32)
        return Q4_1, torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, nb, QK), scale, low
    # Q5_K: [d][dmin][scales][qh: 32][qs: 128 as Q4_K]; bit s of qh byte l: value l of sub-block s
    qs = raw[..., 48:].reshape(n, ns, 4, 1, 32)
    fifth = (raw[..., 16:48, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # (N, ns, 32, 8)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, ns, 8, 32)
    q = q | (fifth.permute(0, 1, 3, 2) << 4)
    return Q8_M, q.reshape(n, nb, QK), scale, low


def pack_blocks(b: QuantBlocks) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Raw blocks -> the kernel format that reads them exactly, and its (values, scales,
    minimums or None).

    Q8_0: int8 (N, K) and scales (N, K/32). Q4_0 / Q4_1: eight rows interleaved (N % 8 == 0),
    the GGUF nibble bytes re-ordered (``interleave_nibbles``). Q4_K: each 32-value sub-block is
    ``(d sc) q - (dmin m)`` with q in 0..15, so it becomes a Q4_1 block with fp32 scale and
    minimum: the Q4_1 kernel then computes what ggml does. Q5_0 (minimum ``-16 d``), Q5_1
    and Q5_K (q in 0..31) are Q8_M; Q6_K (``q - 32`` with a scale per 16) is Q8_16. MIXED: see
    ``_common_format``.
    """
    n, k = b.shape
    if b.qtype == MIXED:
        return _pack_mixed(b.parts)
    if b.qtype in (Q4_0, Q4_1, Q8_0):
        raw = b.data.view(n, k // QK, BLOCK_BYTES[b.qtype])
        if b.qtype == Q8_0:
            values = raw[..., 2:].contiguous().view(torch.int8).view(n, k)
            return Q8_0, values, _f16(raw, 0).contiguous(), None
        packed = interleave_nibbles(raw[..., 2 if b.qtype == Q4_0 else 4 :])
        minimums = None if b.qtype == Q4_0 else by_group(_f16(raw, 2))
        return b.qtype, packed, by_group(_f16(raw, 0)), minimums
    fmt, q, scale, low = _decode(b)
    if fmt == Q4_1:
        nibbles = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        assert low is not None
        return Q4_1, interleave_nibbles(nibbles), by_group(scale), by_group(low)
    values = q.to(torch.int8).reshape(n, k)
    return fmt, values, scale.contiguous(), None if low is None else low.contiguous()


# Fused parts of different types (a Q4_K_M file's Q5_0 q and k beside a Q8_0 v, say) in one
# format that holds each exactly: values 0..31 with a minimum (Q8_M) for the unsigned types, or
# signed int8 (Q8_0; Q8_16 beside Q6_K) for those without a minimum. Q4_0 and Q5_0 fit both.
_UNSIGNED = {Q4_0: 8, Q4_1: 0, Q4_K: 0, Q5_0: 16, Q5_1: 0, Q5_K: 0}  # offset: w = d (q - off)
_SIGNED = {Q4_0: 8, Q5_0: 16, Q8_0: 0, Q6_K: 0}


def _common_format(types: set[int]) -> int | None:
    if types <= _UNSIGNED.keys():
        return Q8_M
    if types <= _SIGNED.keys():
        return Q8_16 if Q6_K in types else Q8_0
    return None


def _values(b: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Any kernel type -> its integers q (N, K / 32, 32), unsigned for the ``_UNSIGNED`` types,
    and scales per 32 (per 16 for Q6_K): w = scale (q - offset), or scale q + minimum."""
    n, k = b.shape
    if b.qtype in (Q4_0, Q4_1, Q8_0):
        raw = b.data.view(n, k // QK, BLOCK_BYTES[b.qtype])
        if b.qtype == Q8_0:
            return raw[..., 2:].contiguous().view(torch.int8).to(torch.int16), _f16(raw, 0)
        qs = raw[..., 2 if b.qtype == Q4_0 else 4 :]
        return torch.cat((qs & 0x0F, qs >> 4), dim=-1).to(torch.int16), _f16(raw, 0)
    _, q, scale, _ = _decode(b)
    return q.to(torch.int16), scale


def _pack_mixed(
    parts: list[QuantBlocks],
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    fmt = _common_format({p.qtype for p in parts})
    qs, scales, lows = [], [], []
    for p in parts:
        q, scale = _values(p)
        if fmt == Q8_M:
            if p.qtype in (Q4_0, Q5_0):  # w = d (q - offset): the minimum is -offset d
                lows.append(scale * -_UNSIGNED[p.qtype])
            elif p.qtype == Q4_1:
                lows.append(_f16(p.data.view(*scale.shape, -1), 2))
            else:  # Q4_K, Q5_1, Q5_K
                low = _decode(p)[3]
                assert low is not None
                lows.append(low)
        else:
            q = q - _SIGNED[p.qtype]
            if fmt == Q8_16 and p.qtype != Q6_K:  # the block's scale for both halves
                scale = scale.repeat_interleave(2, dim=1)
        qs.append(q.to(torch.int8).reshape(p.shape))
        scales.append(scale)
    m = torch.cat(lows).contiguous() if lows else None
    assert fmt is not None  # cat() made a MIXED weight only for types with a common format
    return fmt, torch.cat(qs), torch.cat(scales).contiguous(), m


def interleave_q8(
    fmt: int, values: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An int8 format's rows (N % 8 == 0) -> eight rows interleaved (``q8.c``): for rows
    8g..8g+7 and block b, byte ``32 j + 4 r + i`` holds row r's value ``4 j + i``; scales
    (N/8, nb, 8) ((N/8, nb, 2, 8) for Q8_16) and minimums (N/8, nb, 8) side by side."""
    n, k = values.shape
    g, nb = n // 8, k // QK
    packed = values.reshape(g, 8, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb * 256)
    if fmt == Q8_16:  # (N, 2 nb) -> (G, nb, 2, 8)
        grouped = scales.reshape(g, 8, nb, 2).permute(0, 2, 3, 1).contiguous()
    else:
        grouped = by_group(scales)
    return packed.contiguous(), grouped, None if minimums is None else by_group(minimums)


def pack_q5_m(
    values: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_M (values 0..31 (N, K) int8, scales and minimums (N, K/32)) with N % 8 == 0 -> Q5_M:
    per eight-row group and block, the Q4_1 layout's 128 bytes of low nibbles
    (``interleave_nibbles``) then eight 32-bit words of fifth bits, bit ``4 r + i`` of word
    ``v`` for row r's value ``4 v + i`` (matmul.c); scales and minimums (N/8, K/32, 8)."""
    n, k = values.shape
    g, nb = n // 8, k // QK
    q = values.view(torch.uint8).view(n, nb, QK)
    nibbles = interleave_nibbles((q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)).view(
        g, nb, 128
    )
    fifth = (q >> 4).view(g, 8, nb, 8, 4).permute(0, 2, 3, 1, 4)  # (G, nb, v, r, i)
    shifts = torch.arange(8, dtype=torch.uint8)
    words = (fifth.reshape(g, nb, 32, 8) << shifts).sum(-1, dtype=torch.uint8)  # bits -> bytes
    packed = torch.cat([nibbles, words], -1).reshape(g, nb * 160).contiguous()
    return packed, by_group(scales), by_group(minimums)


def dequantize_blocks(b: QuantBlocks) -> torch.Tensor:
    """The (N, K) fp32 weights the blocks encode (the reference the packing tests compare to)."""
    n, k = b.shape
    if b.qtype == MIXED:
        return torch.cat([dequantize_blocks(p) for p in b.parts])
    if b.qtype not in (Q4_0, Q4_1, Q8_0):
        fmt, q, scale, low = _decode(b)
        if fmt == Q8_16:  # a scale per 16 values
            w = q.float().view(n, -1, 16) * scale[..., None]
            return w.view(n, k)
        w = q.float() * scale[..., None]
        return (w if low is None else w + low[..., None]).view(n, k)
    raw = b.data.view(n, k // QK, BLOCK_BYTES[b.qtype])
    d = _f16(raw, 0)[..., None]
    if b.qtype == Q8_0:
        return (d * raw[..., 2:].contiguous().view(torch.int8).float()).view(n, k)
    qs = raw[..., 2 if b.qtype == Q4_0 else 4 :]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
    if b.qtype == Q4_0:
        return (d * (q - 8.0)).view(n, k)
    return (d * q + _f16(raw, 2)[..., None]).view(n, k)
