"""Hugging Face checkpoint tensors onto the decoders' fused parameters, and their checks.

The models store projections fused (``qkv`` and ``gate_up``) so a decode step runs two matmuls
per block instead of five; a checkpoint names them apart (``q_proj``, ``k_proj``, ``v_proj``,
``gate_proj``, ``up_proj``) under a ``model.`` prefix. ``fused_names`` maps one onto the other,
``check_tensors`` says which tensor is missing, unexpected, mis-shaped or not finite.
"""

from __future__ import annotations

import torch

__all__ = ["WeightError", "check_tensors", "fused_names"]


class WeightError(ValueError):
    """A checkpoint tensor is missing, unexpected or has the wrong shape (named in the message)."""


def _fuse(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """Concatenate projections along the output dim, naming them if their shapes disagree."""
    parts = [tensors.pop(n) for n in names]
    if len({p.shape[1:] for p in parts}) != 1:
        shapes = {n: tuple(p.shape) for n, p in zip(names, parts, strict=True)}
        raise WeightError(f"tensor shapes do not fit together: {shapes}")
    return torch.cat(parts)


def fused_names(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors under the models' parameter names, projections fused."""
    tensors = dict(tensors)
    fused: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        pre = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{pre}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if all(n in tensors for n in names):
                fused[f"layers.{i}.self_attn.qkv.{kind}"] = _fuse(tensors, names)
        names = [f"{pre}mlp.gate_proj.weight", f"{pre}mlp.up_proj.weight"]
        if all(n in tensors for n in names):
            fused[f"layers.{i}.mlp.gate_up.weight"] = _fuse(tensors, names)
    for name, t in tensors.items():
        fused[name.removeprefix("model.")] = t
    return fused


def check_tensors(fused: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> None:
    """Raise ``WeightError`` unless ``fused`` holds exactly the names of ``own``, each of its
    shape and finite (tensors on the meta device are checked by their loader)."""
    missing = sorted(set(own) - set(fused))
    unexpected = sorted(set(fused) - set(own))
    if missing or unexpected:
        raise WeightError(f"missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, t in fused.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise WeightError(
                f"tensor {name}: shape {tuple(t.shape)}, expected {tuple(own[name].shape)}"
            )
        if not t.is_meta and not torch.isfinite(t).all():
            raise WeightError(f"tensor {name} holds NaN or infinite values")
