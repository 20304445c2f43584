"""The Qwen3 architecture: Llama attention plus a per-head RMSNorm on queries and keys.

Owns ``Qwen3Attention``; everything else comes from ``llama.py``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch

from services.worker.models.llama import Attention, LlamaConfig, LlamaModel, RMSNorm

__all__ = ["Qwen3Attention", "Qwen3Model"]


class Qwen3Attention(Attention):
    """Attention with ``q_norm``/``k_norm`` over each head's features, applied before RoPE."""

    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise (B, T, H, hd) queries and (B, T, KV, hd) keys per head."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3Model(LlamaModel):
    """Qwen3 dense decoder."""

    attention_cls: ClassVar[type[Attention]] = Qwen3Attention

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build the config from a Hugging Face ``config.json`` dict (no o_proj bias)."""
        base = LlamaConfig.from_hf(cfg)
        return replace(base, o_bias=False)
