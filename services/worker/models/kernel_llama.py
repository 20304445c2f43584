"""A Llama-family model's decode step on sluice's CPU kernels (Q4_1 / Q8_0 blocks).

Owns packing a loaded ``LlamaModel``'s linears into 4-bit (Q4_1) blocks and its output head into
8-bit (Q8_0) blocks, and ``QuantizedLlama``, which runs a decode step (one new token per row) as
one call into ``services.worker.kernels`` instead of ~1,500 torch ops. The math is the model's
own (same RMSNorm, RoPE convention, GQA, SwiGLU, KV-cache layout), with activations quantized to
8 bits per 32 values before each matmul, so tests compare the two paths step by step.

Prefill (many tokens per row) runs the same kernels for every matmul (the interleaved Q4_1 GEMM
beats oneDNN's fp32 GEMM by ~1.5x at prefill sizes on AVX2) and the dense model's own
``Attention.attend`` (torch SDPA) for attention. The dense linears are then freed.

Why Q4_1 for the blocks: a Q4_1 GGUF block is ``w = d * q + m`` over 32 weights, so
re-quantizing its dequantized weights reproduces it (whenever the block spans 0..15, i.e.
almost always). The head of the default model is its Q8_0 token embedding, likewise reproduced.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from services.worker.kernels import QK, Activations, Kernels, Layer, Linear, Model, Scratch
from services.worker.kv_cache import AttentionBatch, KVCache
from services.worker.models.llama import Attention, Block, LlamaModel

__all__ = [
    "Activations",
    "PackedLinear",
    "QuantizedLlama",
    "pack_q4_1",
    "pack_q8_0",
    "supports",
    "unpack_q4_1",
]


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


def supports(model: nn.Module) -> bool:
    """Whether the kernels fit ``model``: fp32 on CPU, every block matmul's inputs split into
    32-value blocks and its outputs into groups of eight rows."""
    if not isinstance(model, LlamaModel):
        return False
    cfg = model.config
    widths = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    outputs = (cfg.hidden_size, 2 * cfg.intermediate_size, (cfg.num_heads + 2 * cfg.num_kv_heads))
    weight = model.embed_tokens.weight
    return (
        all(w % QK == 0 for w in widths)
        and all(o % 8 == 0 for o in outputs[:2])
        and outputs[2] * cfg.head_dim % 8 == 0
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
    )


class PackedLinear:
    """``y (+)= x @ W.T + b`` on packed blocks: Q4_1 for block linears, Q8_0 for the head."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> None:
        self.out_features, self.in_features = weight.shape
        self.fmt = fmt
        if fmt == "q4_1":
            self.q, self.d, self.m = pack_q4_1(weight)
        else:
            self.q, self.d = pack_q8_0(weight)
            self.m = self.d  # unused by the Q8_0 kernel
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def struct(self) -> Linear:
        """The kernels' view of this linear (the tensors must outlive it)."""
        return Linear(
            self.q.data_ptr(),
            self.d.data_ptr(),
            self.m.data_ptr(),
            _ptr(self.bias),
            self.out_features,
            self.in_features,
        )

    def __call__(
        self, k: Kernels, x: Activations, y: torch.Tensor, *, accumulate: bool = False
    ) -> None:
        """Write (or add) the product for ``x``'s rows into ``y`` (rows, out_features) fp32."""
        bias = 0 if self.bias is None else self.bias.data_ptr()
        args = (x.rows, self.out_features, self.in_features, x.q.data_ptr(), x.d.data_ptr())
        if self.fmt == "q4_1":
            k.lib.sl_gemm_q4_1(
                *args, x.s.data_ptr(), self.q.data_ptr(), self.d.data_ptr(), self.m.data_ptr(),
                bias, y.data_ptr(), int(accumulate), k.threads(),
            )  # fmt: skip
        else:
            k.lib.sl_gemm_q8_0(
                *args, self.q.data_ptr(), self.d.data_ptr(), bias, y.data_ptr(),
                int(accumulate), k.threads(),
            )  # fmt: skip


@dataclass
class PackedBlock:
    """One transformer block's weights in the kernels' formats."""

    input_norm: torch.Tensor  # (C,)
    qkv: PackedLinear
    q_norm: torch.Tensor | None  # (hd,) Qwen3 only
    k_norm: torch.Tensor | None
    o_proj: PackedLinear
    post_norm: torch.Tensor  # (C,)
    gate_up: PackedLinear
    down: PackedLinear

    @classmethod
    def from_block(cls, block: Block) -> PackedBlock:
        attn: Attention = block.self_attn
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return cls(
            input_norm=block.input_layernorm.weight.detach().float().contiguous(),
            qkv=PackedLinear(attn.qkv.weight, attn.qkv.bias, "q4_1"),
            q_norm=None if q_norm is None else q_norm.weight.detach().float().contiguous(),
            k_norm=None if k_norm is None else k_norm.weight.detach().float().contiguous(),
            o_proj=PackedLinear(attn.o_proj.weight, attn.o_proj.bias, "q4_1"),
            post_norm=block.post_attention_layernorm.weight.detach().float().contiguous(),
            gate_up=PackedLinear(block.mlp.gate_up.weight, None, "q4_1"),
            down=PackedLinear(block.mlp.down_proj.weight, None, "q4_1"),
        )

    def struct(self) -> Layer:
        """The kernels' view of this block (the tensors must outlive it)."""
        return Layer(
            self.input_norm.data_ptr(),
            self.post_norm.data_ptr(),
            _ptr(self.q_norm),
            _ptr(self.k_norm),
            self.qkv.struct(),
            self.o_proj.struct(),
            self.gate_up.struct(),
            self.down.struct(),
        )


class QuantizedLlama(nn.Module):
    """``LlamaModel``'s forward with decode steps on the CPU kernels (same signature)."""

    def __init__(self, model: LlamaModel, kernels: Kernels) -> None:
        super().__init__()
        self.model = model  # embeddings, RoPE tables and Attention.attend (linears freed below)
        self.config = cfg = model.config
        self.kernels = kernels
        layers = [cast(Block, b) for b in model.layers]
        self.blocks = [PackedBlock.from_block(b) for b in layers]
        self.attention = [b.self_attn for b in layers]  # prefill reuses Attention.attend
        self.final_norm = model.norm.weight.detach().float().contiguous()
        self.head = PackedLinear(model.lm_head.weight, model.lm_head.bias, "q8_0")
        _release_dense(model)  # after every PackedLinear above has copied what it needs
        self.layer_structs = (Layer * len(self.blocks))(*(b.struct() for b in self.blocks))
        self.struct = Model(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            model.rope_cos.data_ptr(),  # (ctx, hd) fp32, contiguous, kept alive by self.model
            model.rope_sin.data_ptr(),
            self.final_norm.data_ptr(),
            self.layer_structs,
            self.head.struct(),
        )
        self.scratch: dict[int, tuple[Scratch, list[torch.Tensor]]] = {}
        # The widest matmul input: every quantized activation buffer is sized for it.
        self.act_width = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)

    def forward(
        self, idx: torch.Tensor, batch: AttentionBatch, cache: KVCache, n_logits: int = 1
    ) -> torch.Tensor:
        """Logits (B, n_logits, V) fp32 of the last ``n_logits`` positions of each row."""
        if batch.t == 1 and n_logits == 1:
            return self.decode(idx, batch, cache)
        return self.prefill(idx, batch, cache, n_logits)

    def prefill(
        self, idx: torch.Tensor, batch: AttentionBatch, cache: KVCache, n_logits: int
    ) -> torch.Tensor:
        """Many tokens per row: the projections and MLP on the kernels, attention in torch
        (the dense model's own ``Attention.attend``: causal SDPA over the cache)."""
        k, cfg = self.kernels, self.config
        B, T = idx.shape
        rows, C, eps = B * T, cfg.hidden_size, cfg.rms_norm_eps
        x = self.model.embed_tokens(idx).view(rows, C).contiguous()  # residual stream
        act = Activations(rows, self.act_width)
        qkv = torch.empty(rows, self.blocks[0].qkv.out_features)
        gate_up = torch.empty(rows, 2 * cfg.intermediate_size)
        cos, sin = self.model.rope_at(batch.positions, torch.float32)  # (B, 1, T, hd)
        for blk, attention in zip(self.blocks, self.attention, strict=True):
            k.rmsnorm_quantize(x, blk.input_norm, eps, act)
            blk.qkv(k, act, qkv)
            y = attention.attend(qkv.view(B, T, -1), cos, sin, batch, cache)  # (B, T, H hd)
            k.quantize(y.reshape(rows, -1).contiguous(), act)
            blk.o_proj(k, act, x, accumulate=True)
            k.rmsnorm_quantize(x, blk.post_norm, eps, act)
            blk.gate_up(k, act, gate_up)
            k.swiglu_quantize(gate_up, act)
            blk.down(k, act, x, accumulate=True)
        last = x.view(B, T, C)[:, -n_logits:].reshape(B * n_logits, C).contiguous()
        head_in = Activations(B * n_logits, C)
        k.rmsnorm_quantize(last, self.final_norm, eps, head_in)
        logits = torch.empty(B * n_logits, self.head.out_features)
        self.head(k, head_in, logits)
        return logits.view(B, n_logits, -1)

    def _scratch(self, rows: int, span: int) -> Scratch:
        """Buffers for ``rows`` rows attending over up to ``span`` keys (reused across steps)."""
        cfg = self.config
        held = self.scratch.get(rows)
        if held is None or held[1][-1].numel() < rows * cfg.num_heads * span:
            act = Activations(rows, self.act_width)
            tensors = [
                act.q,
                act.d,
                act.s,
                act.tmp,
                torch.empty(rows, self.blocks[0].qkv.out_features),
                torch.empty(rows, cfg.num_heads * cfg.head_dim),  # attended
                torch.empty(rows, 2 * cfg.intermediate_size),  # gate_up
                torch.empty(rows * cfg.num_heads * max(span, 256) * 2),  # scores
            ]
            held = (Scratch(*(t.data_ptr() for t in tensors)), tensors)
            self.scratch[rows] = held
        return held[0]

    def decode(self, idx: torch.Tensor, batch: AttentionBatch, cache: KVCache) -> torch.Tensor:
        """One new token per row: (B, 1) ids -> (B, 1, V) logits, in one call to the kernels."""
        B = idx.shape[0]
        x = self.model.embed_tokens(idx.view(B)).contiguous()  # (B, C) residual stream
        logits = torch.empty(B, self.head.out_features)
        positions = batch.start_index.contiguous()  # (B,) the new token's position
        slots = batch.slot_index.contiguous()
        span = int(batch.span)
        self.kernels.lib.sl_decode(
            ctypes.byref(self.struct),
            B,
            x.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            cache.k.data_ptr(),
            cache.v.data_ptr(),
            cache.slots,
            cache.capacity,
            span,
            ctypes.byref(self._scratch(B, span)),
            logits.data_ptr(),
            self.kernels.threads(),
        )
        return logits.view(B, 1, -1)


def _release_dense(model: LlamaModel) -> None:
    """Free the fp32 weights the packed blocks replace (7/8 of a 4-bit model's memory); the
    dense model keeps embeddings, norms, RoPE tables and ``Attention.attend``, and can no longer
    run its own forward."""
    for layer in model.layers:
        block = cast(Block, layer)
        attn, mlp = block.self_attn, block.mlp
        for linear in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj):
            linear.weight.data = torch.empty(0)
            if linear.bias is not None:
                linear.bias.data = torch.empty(0)
    if model.lm_head.weight is not model.embed_tokens.weight:
        model.lm_head.weight.data = torch.empty(0)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
