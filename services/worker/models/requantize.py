"""Dense weights re-quantized into the kernels' layouts (``sluice_cpu.h``): where a linear has no
blocks a kernel reads as they are (an F16/BF16 tensor, a type without a kernel, a model loaded
dense and asked for ``int4``), ``PackedLinear`` quantizes it as Q4_1 (eight rows interleaved, as
``blocks.pack_blocks`` lays out a file's Q4_1) or Q8_0, as llama.cpp's quantizers do: per 32
values, the block's range (Q4_1) or its largest magnitude (Q8_0)."""

from __future__ import annotations

import torch

from services.worker.models.blocks import QK, by_group, interleave_nibbles

__all__ = ["pack_q4_1", "pack_q8_0", "unpack_q4_1"]


def pack_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) weights -> Q4_1 with eight rows interleaved (the layout ``sluice_cpu.h`` documents).

    Returns nibbles (N/8, K/32 * 128) uint8, scales and minimums (N/8, K/32, 8) fp32. In each
    128-byte block, byte ``32 j + 4 r + i`` holds row r's value ``4 j + i`` (low nibble) and
    value ``16 + 4 j + i`` (high nibble).
    """
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // QK, QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = (hi - lo) / 15.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = ((blocks - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    nibbles = interleave_nibbles(q[..., :16] | (q[..., 16:] << 4))  # the file's byte order first
    return nibbles, by_group(scale), by_group(lo)


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
