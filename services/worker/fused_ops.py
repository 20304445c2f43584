"""Fused Triton kernels for the GPU decoder: RMSNorm, SwiGLU's gate, and rotary embedding with
the store into the paged KV cache.

Why: a decode step of a small model is launch-bound even inside a CUDA graph, where each kernel
still costs the GPU a couple of microseconds. In eager PyTorch an RMSNorm is eight kernels
(cast, square, mean, add, rsqrt, multiply, cast, scale), rotary embedding five per tensor and
the cache store another eight (index arithmetic, two scatters); SmolLM2's 30 layers came to
about 1,500 kernels a step, 2.5 ms on an H200 whatever the batch. Each op here is one kernel
with the same arithmetic (fp32 inside, rounded where PyTorch rounds).

The residual stream's adds go into the next norm (``add_rms_norm``): a block hands its MLP
output on un-added, and the next block's first kernel adds it and normalises.

Used where ``wanted`` says so: CUDA tensors with Triton present (tests set ``FORCE`` to run them
through Triton's interpreter on CPU tensors).
"""

from __future__ import annotations

import torch

try:  # Triton ships with torch's CUDA builds; the CPU wheel has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

HAVE_TRITON = triton is not None

__all__ = ["FORCE", "add_rms_norm", "rms_norm", "rope_store", "silu_mul", "wanted"]

FORCE = False  # tests: run the kernels on CPU tensors (under TRITON_INTERPRET=1)


def wanted(x: torch.Tensor) -> bool:
    """Whether ``x``'s ops take the fused kernels."""
    return HAVE_TRITON and (x.is_cuda or FORCE)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dim of ``x`` (rows, d) or (rows, heads, d),
    the normalised value rounded to ``x``'s dtype before the scale, as ``models.llama.RMSNorm``."""
    d = x.shape[-1]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x3.shape, dtype=torch.result_type(weight, x), device=x.device)
    _rms_kernel[(x3.shape[0], x3.shape[1])](
        x3, weight, out, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), d, eps,
        BLOCK=_pow2(d),
    )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one pass over (n, d) rows: ``x + delta`` (rounded
    to the dtype, as PyTorch's add) and ``rms_norm`` of it."""
    n, d = x.shape
    total = torch.empty_like(x)
    out = torch.empty(n, d, dtype=torch.result_type(weight, x), device=x.device)
    _add_rms_kernel[(n,)](
        x, delta, weight, total, out, x.stride(0), delta.stride(0), d, eps, BLOCK=_pow2(d)
    )
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(n, 2 I) -> ``silu(gate) * up`` (n, I), each rounded to the dtype as PyTorch does."""
    n, two = gate_up.shape
    inner = two // 2
    out = torch.empty(n, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(inner, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inner, BLOCK=block
    )
    return out


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` (n, H, hd) and ``k`` (n, KV, hd) by the rows' ``cos``/``sin`` (n, hd) fp32
    (Hugging Face's rotate-half convention), store the rotated keys and ``v`` in one layer's
    paged cache (KV, blocks, block_size, hd) at each row's position, and return the rotated
    queries and keys (n, H, hd), (n, KV, hd)."""
    n, H, hd = q.shape
    KV = k.shape[1]
    q_out = torch.empty(n, H, hd, dtype=q.dtype, device=q.device)
    k_out = torch.empty(n, KV, hd, dtype=k.dtype, device=k.device)
    _rope_store_kernel[(n, H + KV)](
        q, k, v, cos, sin, positions, seq_index, tables, k_cache, v_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=H, HALF=hd // 2, HALF_PAD=_pow2(hd // 2), BS=k_cache.shape[2],
    )  # fmt: skip
    return q_out, k_out


if triton is not None:

    @triton.jit
    def _rms_kernel(
        x_ptr, w_ptr, out_ptr, stride_xn, stride_xh, stride_on, stride_oh, d, eps,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < d
        raw = tl.load(x_ptr + row * stride_xn + head * stride_xh + cols, mask=ok, other=0.0)
        x = raw.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / d + eps)
        normed = (x * scale).to(raw.dtype).to(tl.float32)  # x.to(dtype), as the module rounds
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        out_at = out_ptr + row * stride_on + head * stride_oh + cols
        tl.store(out_at, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_rms_kernel(
        x_ptr, delta_ptr, w_ptr, total_ptr, out_ptr, stride_x, stride_d, d, eps,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < d
        raw = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        step = tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0)
        total = (raw.to(tl.float32) + step.to(tl.float32)).to(raw.dtype)
        tl.store(total_ptr + row * d + cols, total, mask=ok)
        x = total.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / d + eps)
        normed = (x * scale).to(raw.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * d + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inner
        gate_raw = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * stride_x + inner + cols, mask=ok, other=0.0).to(tl.float32)
        gate = gate_raw.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(gate_raw.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (act * up).to(gate_raw.dtype), mask=ok)

    @triton.jit
    def _rope_store_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, seq_ptr, tables_ptr, kc_ptr, vc_ptr,
        q_out_ptr, k_out_ptr,
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cos,
        stride_table, stride_ch, stride_cb, stride_ct,
        H: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        i = tl.arange(0, HALF_PAD)
        ok = i < HALF
        c1 = tl.load(cos_ptr + row * stride_cos + i, mask=ok, other=0.0)
        c2 = tl.load(cos_ptr + row * stride_cos + HALF + i, mask=ok, other=0.0)
        s1 = tl.load(sin_ptr + row * stride_cos + i, mask=ok, other=0.0)
        s2 = tl.load(sin_ptr + row * stride_cos + HALF + i, mask=ok, other=0.0)
        if head < H:  # a query head: rotate into q_out
            q_in = q_ptr + row * stride_qn + head * stride_qh
            x1 = tl.load(q_in + i, mask=ok, other=0.0)
            x2 = tl.load(q_in + HALF + i, mask=ok, other=0.0)
            q_at = q_out_ptr + (row * H + head) * (2 * HALF)
            a1 = x1.to(tl.float32) * c1 - x2.to(tl.float32) * s1
            a2 = x2.to(tl.float32) * c2 + x1.to(tl.float32) * s2
            tl.store(q_at + i, a1.to(x1.dtype), mask=ok)
            tl.store(q_at + HALF + i, a2.to(x1.dtype), mask=ok)
        else:  # a KV head: rotate the key, store key and value in the cache
            j = head - H
            kv_heads = tl.num_programs(1) - H
            at = k_ptr + row * stride_kn + j * stride_kh
            x1 = tl.load(at + i, mask=ok, other=0.0)
            x2 = tl.load(at + HALF + i, mask=ok, other=0.0)
            r1 = (x1.to(tl.float32) * c1 - x2.to(tl.float32) * s1).to(x1.dtype)
            r2 = (x2.to(tl.float32) * c2 + x1.to(tl.float32) * s2).to(x1.dtype)
            out = k_out_ptr + (row * kv_heads + j) * (2 * HALF)
            tl.store(out + i, r1, mask=ok)
            tl.store(out + HALF + i, r2, mask=ok)
            pos = tl.load(pos_ptr + row)
            seq = tl.load(seq_ptr + row).to(tl.int64)
            block = tl.load(tables_ptr + seq * stride_table + pos // BS).to(tl.int64)
            slot = j.to(tl.int64) * stride_ch + block * stride_cb + (pos % BS) * stride_ct
            tl.store(kc_ptr + slot + i, r1.to(kc_ptr.dtype.element_ty), mask=ok)
            tl.store(kc_ptr + slot + HALF + i, r2.to(kc_ptr.dtype.element_ty), mask=ok)
            vat = v_ptr + row * stride_vn + j * stride_vh
            v1 = tl.load(vat + i, mask=ok, other=0.0)
            v2 = tl.load(vat + HALF + i, mask=ok, other=0.0)
            tl.store(vc_ptr + slot + i, v1.to(vc_ptr.dtype.element_ty), mask=ok)
            tl.store(vc_ptr + slot + HALF + i, v2.to(vc_ptr.dtype.element_ty), mask=ok)
