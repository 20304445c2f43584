"""The Llama architecture (SmolLM2, Llama 2/3) and the building blocks other decoders reuse.

Owns the transformer forward only: RMSNorm, rotary embeddings, grouped-query attention over the
engine's paged KV cache, SwiGLU MLP (on a GPU through ``fused_ops``' kernels). It knows nothing
about sampling, batching policy or tokenizers; Qwen2, Qwen3 and Mistral import these modules
rather than copying them.

Weights are stored fused (``qkv`` and ``gate_up``) so a decode step runs two matmuls per block
instead of five; ``load_hf_weights`` maps Hugging Face tensor names onto them
(``checkpoint.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from services.worker import fused_ops
from services.worker.kv_cache import AttentionBatch, PagedKVCache
from services.worker.models.checkpoint import WeightError, check_tensors, fused_names
from services.worker.paged_attention import paged_attention

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "LlamaConfig",
    "LlamaModel",
    "RMSNorm",
    "WeightError",
    "rope_inv_freq",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (``config.json`` names in the comments)."""

    vocab_size: int = 32000  # vocab_size
    hidden_size: int = 4096  # hidden_size
    intermediate_size: int = 11008  # intermediate_size
    num_layers: int = 32  # num_hidden_layers
    num_heads: int = 32  # num_attention_heads
    num_kv_heads: int = 32  # num_key_value_heads (GQA when < num_heads)
    head_dim: int = 128  # head_dim (default hidden_size // num_heads)
    rope_theta: float = 10000.0  # rope_theta
    rope_scaling: dict[str, Any] | None = None  # rope_scaling ({"rope_type": "llama3", ...})
    rms_norm_eps: float = 1e-6  # rms_norm_eps
    context_length: int = 2048  # max_position_embeddings
    tie_word_embeddings: bool = False  # tie_word_embeddings (lm_head = embed_tokens)
    qkv_bias: bool = False  # attention_bias (Llama) / always True for Qwen2
    o_bias: bool = False  # attention_bias applies to o_proj in Llama, never in Qwen2
    extra: dict[str, Any] = field(default_factory=dict)  # architecture-specific notes

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build a config from a Hugging Face ``config.json`` dict."""
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama 3 frequency scaling when the config asks for it."""
    dim = cfg.head_dim
    inv = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    )
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        inv = scaled
    elif kind not in (None, "default"):
        raise WeightError(f"unsupported rope scaling type {kind!r}")
    return inv.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face RoPE convention: rotate pairs (i, i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 for stability under bf16."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.wanted(x):  # one kernel instead of eight (GPU)
            return fused_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def grouped_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One-token attention with GQA done by grouping queries, not by repeating K/V.

    q (B, H, 1, hd), keys and values (B, KV, S, hd), mask (B, S) True where a key may be read.
    SDPA with both a ragged mask and ``enable_gqa`` falls back to its slow math path (about
    1 ms per layer on CUDA); four matmul-sized ops do the same work.
    """
    B, H, _, hd = q.shape
    KV, S = keys.shape[1], keys.shape[2]
    qg = q.view(B, KV, H // KV, hd)  # (B, KV, G, hd)
    att = (qg @ keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd))  # (B, KV, G, S)
    att = att.masked_fill(~mask.view(B, 1, 1, S), float("-inf"))
    y = att.softmax(dim=-1).to(values.dtype) @ values  # (B, KV, G, hd)
    return y.view(B, H, 1, hd)


class Attention(nn.Module):
    """Grouped-query self-attention that reads and writes the engine's paged KV cache."""

    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (self.n_head + 2 * self.n_kv) * self.hd
        self.scale = 1.0 / math.sqrt(self.hd)
        self.qkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_head * self.hd, cfg.hidden_size, bias=cfg.o_bias)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for per-head q/k normalisation (Qwen3); Llama has none."""
        return q, k

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv(x), cos, sin, batch, cache))

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """Projected (n, (H + 2 KV) * hd) token rows -> attention output (n, H * hd).

        Sequences decoding one token attend together: on a GPU through the block tables in
        the Triton kernel (``paged_attention``), elsewhere by one gather and a masked batch. A
        sequence with several new rows (a prompt chunk) attends on its own, causally, in SDPA.
        """
        n = qkv.shape[0]
        q, k, v = qkv.split([self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        q, k = self.norm_qk(q.view(n, self.n_head, self.hd), k.view(n, self.n_kv, self.hd))
        v = v.view(n, self.n_kv, self.hd)
        if cache.paged_kernel:  # GPU: rotate and store in one kernel; cos, sin fp32 here
            cos, sin = cos.squeeze(1), sin.squeeze(1)
            at = (batch.tables, batch.seq_index, batch.positions)
            kc, vc = cache.k[self.layer], cache.v[self.layer]
            q, k = fused_ops.rope_store(q, k, v, cos, sin, kc, vc, *at)
        else:
            q = q * cos + rotate_half(q) * sin  # cos, sin (n, 1, hd)
            k = k * cos + rotate_half(k) * sin
            cache.write(self.layer, k, v, batch)
        if cache.paged_kernel and batch.decode_only:  # a decode step (a captured graph's)
            y = self.paged(q, batch.seq_index, batch.positions, batch, cache)
            return y.reshape(n, self.n_head * self.hd)
        y = torch.empty_like(q)  # (n, H, hd)
        group = batch.decoding  # built by the first layer, reused by the others
        if group is not None and cache.paged_kernel:
            rows = group.rows
            y[rows] = self.paged(
                q[rows], batch.seq_index[rows], batch.positions[rows], batch, cache
            )
        elif group is not None:
            keys, values = cache.read(self.layer, group.tables, group.span)  # (b, KV, S, hd)
            out = grouped_decode_attention(
                q[group.rows].unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), group.mask
            )  # (b, H, 1, hd)
            y[group.rows] = out[:, :, 0]
        for i, s in enumerate(batch.seqs):
            if s.count == 1:
                continue
            first, span = batch.firsts[i], s.start + s.count
            qi = q[first : first + s.count].transpose(0, 1).unsqueeze(0)  # (1, H, T, hd)
            causal = s.start == 0  # nothing cached before: SDPA's fused causal kernels
            mask: torch.Tensor | None = None
            if causal:  # the chunk's own keys, as computed: no read of the cache
                keys = k[first : first + s.count].transpose(0, 1).unsqueeze(0)  # (1, KV, T, hd)
                values = v[first : first + s.count].transpose(0, 1).unsqueeze(0)
            else:
                keys, values = cache.read(self.layer, batch.tables[i : i + 1], span)
                keys_at = torch.arange(span, device=q.device)
                mask = keys_at[None, :] <= batch.positions[first : first + s.count, None]
            out = F.scaled_dot_product_attention(
                qi,
                keys.to(q.dtype),
                values.to(q.dtype),
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=self.n_kv != self.n_head,
            )  # (1, H, T, hd)
            y[first : first + s.count] = out[0].transpose(0, 1)
        return y.reshape(n, self.n_head * self.hd)

    def paged(
        self,
        q: torch.Tensor,
        seq_index: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """Single-token rows ``q`` (r, H, hd) through the block tables (``paged_attention``)."""
        layer = self.layer
        return paged_attention(
            q, cache.k[layer], cache.v[layer], batch.tables, seq_index, positions, self.scale
        )


class MLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.gate_up(x)  # (n, 2 I)
        if fused_ops.wanted(both):
            return self.down_proj(fused_ops.silu_mul(both))
        gate, up = both.chunk(2, dim=-1)  # (n, I) each
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, layer: int, attention_cls: type[Attention]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
        pending: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream after this block, and on the GPU the MLP's output not yet added
        to it: the next block's first kernel adds ``pending`` and normalises in one pass
        (``fused_ops.add_rms_norm``: two kernels a layer fewer). Elsewhere ``pending`` stays
        None and the adds are torch's."""
        if not fused_ops.wanted(x):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
            return x + self.mlp(self.post_attention_layernorm(x)), None
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if pending is None:
            h = norm1(x)
        else:
            x, h = fused_ops.add_rms_norm(x, pending, norm1.weight, norm1.eps)
        x, h = fused_ops.add_rms_norm(
            x, self.self_attn(h, cos, sin, batch, cache), norm2.weight, norm2.eps
        )
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    """Decoder-only transformer; ``forward`` returns logits of the batch's ``logit_rows``."""

    attention_cls: ClassVar[type[Attention]] = Attention

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build the config from a Hugging Face ``config.json`` dict."""
        return LlamaConfig.from_hf(cfg)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [Block(cfg, i, self.attention_cls) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cpu = torch.device("cpu")  # explicit: the model may be built under torch.device("meta")
        positions = torch.arange(cfg.context_length, device=cpu).float()
        freqs = torch.outer(positions, rope_inv_freq(cfg).to(cpu))
        emb = torch.cat((freqs, freqs), dim=-1)  # (ctx, hd)
        # Plain attributes, not buffers: model.to(bfloat16) must not round the fp32 tables.
        self.rope_cos, self.rope_sin = emb.cos(), emb.sin()

    def rope_at(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos and sin (n, 1, hd) for (n,) ``positions``, in ``dtype`` (broadcast over
        heads)."""
        cos = self.rope_cos[positions].unsqueeze(1).to(dtype)
        sin = self.rope_sin[positions].unsqueeze(1).to(dtype)
        return cos, sin

    def forward(
        self, idx: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """Run token rows ``idx`` (n,) at ``batch.positions``; logits (m, V) fp32 of the rows
        ``batch.logit_rows``."""
        if self.rope_cos.device != idx.device:
            self.rope_cos, self.rope_sin = (
                self.rope_cos.to(idx.device),
                self.rope_sin.to(idx.device),
            )
        x = self.embed_tokens(idx)  # (n, C)
        # the GPU's fused rotary kernel multiplies in fp32; torch's ops in the model's dtype
        cos, sin = self.rope_at(batch.positions, torch.float32 if cache.paged_kernel else x.dtype)
        pending = None
        for block in self.layers:
            x, pending = block(x, cos, sin, batch, cache, pending)
        if pending is not None:
            x = x + pending
        x = self.norm(x[batch.logit_rows])  # (m, C): no lm_head for the other prompt rows
        m = x.shape[0]
        if x.device.type == "cpu" and 1 < m < 4:
            # torch's CPU GEMM takes a slower path for 2 or 3 rows: SmolLM2's fp32 head (49152
            # x 576) took 26.5 and 44.9 ms for 2 and 3 rows, 22.9 ms for 4 (torch 2.13, 2 threads)
            x = torch.cat([x, x.new_zeros(4 - m, x.shape[1])])
        return self.lm_head(x)[:m].float()  # (m, V)

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters.

        Raises:
            WeightError: a tensor is missing, unexpected, or has the wrong shape.
        """
        fused = fused_names(tensors, self.config.num_layers)
        own = self.state_dict()
        if self.config.tie_word_embeddings:
            fused.pop("lm_head.weight", None)
            own.pop("lm_head.weight", None)
        check_tensors(fused, own)
        # assign=True adopts the tensors, so a model built on the meta device needs no init pass.
        self.load_state_dict(fused, strict=False, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
