"""Weight-only int4/int8 linears for CPU decode.

Used with ``SLUICE_DTYPE=int4``, and by default (``auto``) on CPU for a Q4_0/Q4_1 GGUF.

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

__all__ = ["Int4Linear", "Int8Linear", "quantize_linears"]

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


class Int8Linear(nn.Module):
    """``y = x @ W.T`` with W as int8 and one scale per output row (for the lm_head).

    The default model's lm_head is its tied Q8_0 embedding: 113 MB as fp32, two thirds of the
    per-token weight stream once the blocks are int4. Per-row int8 is coarser than Q8_0's
    per-32 scales, so it is used for the output projection only, where an error moves logits
    by about 1 % and the reference answers stay token-identical (tested).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (V, C)
        scale = w.abs().amax(dim=1).clamp(min=1e-10) / 127.0
        self.weight_int8 = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scales = scale.to(torch.bfloat16)
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (B, T, C)
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight_int8, self.scales
        )  # (B*T, V)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, group: int = GROUP) -> int:
    """Replace block linears with ``Int4Linear`` and the ``lm_head`` with ``Int8Linear``.

    Linears whose input size does not divide into groups stay dense.

    Returns:
        How many layers were replaced.
    """
    count = 0
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        model.lm_head = Int8Linear(head)
        count += 1
    for block in getattr(model, "layers", []):
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child.in_features % group == 0:
                    setattr(parent, name, Int4Linear(child, group))
                    count += 1
    return count
