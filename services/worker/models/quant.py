"""Weight-only int4 linears for CPU decode (opt-in with ``SLUICE_DTYPE=int4``).

Owns re-packing a dense ``nn.Linear`` into torch's CPU int4 group-wise format and the module that
multiplies with it. Decode on CPU is bound by streaming weights (538 MB of fp32 per token for the
default model); int4 with one scale and zero per 32 inputs streams an eighth of that. A Q4_1 GGUF
block is exactly this format (``w = d * q + m`` per 32 weights), so re-quantising its dequantised
weights is lossless whenever a block uses both ends of its 0..15 range. Activations go through
the kernel in bf16; the result returns in the caller's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Int4Linear", "quantize_linears"]

GROUP = 32


class Int4Linear(nn.Module):
    """``y = x @ W.T + b`` with W stored as packed int4, one (scale, zero) per group of inputs."""

    def __init__(self, linear: nn.Linear, group: int = GROUP) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape  # (out, in)
        wg = w.view(n, k // group, group)  # (N, K/g, g)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        scale = (hi - lo).clamp(min=1e-10) / 15.0
        q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        self.group, self.out_features = group, n
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
        # The kernel dequantises (q - 8) * scale + zero; our grid is q * scale + lo.
        zero = lo + 8.0 * scale
        sz = torch.stack([scale.view(n, -1).t(), zero.view(n, -1).t()], dim=-1)  # (K/g, N, 2)
        self.scales_and_zeros = sz.contiguous().to(torch.bfloat16)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (B, T, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16),
            self.packed,
            self.group,
            self.scales_and_zeros,
        ).to(x.dtype)  # (B*T, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, group: int = GROUP) -> int:
    """Replace every block ``nn.Linear`` whose input size divides into groups (not the lm_head).

    Returns:
        How many layers were replaced.
    """
    count = 0
    for block in getattr(model, "layers", []):
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child.in_features % group == 0:
                    setattr(parent, name, Int4Linear(child, group))
                    count += 1
    return count
