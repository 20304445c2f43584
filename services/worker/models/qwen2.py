"""The Qwen2 architecture: Llama with a bias on the q/k/v projections (none on o_proj).

Owns only the config mapping; every module comes from ``llama.py``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.worker.models.llama import LlamaConfig, LlamaModel

__all__ = ["Qwen2Model", "qwen2_config"]


def qwen2_config(cfg: dict[str, Any]) -> LlamaConfig:
    """Map a Qwen2 ``config.json`` dict onto a Llama config with q/k/v biases."""
    return replace(LlamaConfig.from_hf(cfg), qkv_bias=True, o_bias=False)


class Qwen2Model(LlamaModel):
    """Qwen2 / Qwen2.5 decoder: identical forward to Llama; the biases live in the config."""

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build the config from a Hugging Face ``config.json`` dict."""
        return qwen2_config(cfg)
