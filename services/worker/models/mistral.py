"""The Mistral architecture: Llama with an optional sliding attention window.

Owns only the config mapping. The sliding window is not implemented: the loader caps the context
at the window, where full attention and sliding-window attention are the same computation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.worker.models.llama import LlamaConfig, LlamaModel

__all__ = ["MistralModel"]


class MistralModel(LlamaModel):
    """Mistral 7B-style decoder (GQA, SwiGLU, RoPE)."""

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build the config; ``sliding_window`` caps the context (see the module docstring)."""
        base = LlamaConfig.from_hf(cfg)
        window = cfg.get("sliding_window")
        if window and int(window) < base.context_length:
            return replace(base, context_length=int(window), extra={"sliding_window": window})
        return base
