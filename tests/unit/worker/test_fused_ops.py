"""The GPU decoder's fused kernels against the torch ops they replace, through Triton's
interpreter on CPU tensors (compiled where a GPU is present): RMSNorm on rows and on strided
per-head views, SwiGLU's gate, rotary embedding with the store into the paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker import fused_ops
from services.worker.kv_cache import PagedKVCache, build_batch
from services.worker.models.llama import RMSNorm, rotate_half
from tests.model_runs import rows_for
from tests.unit.worker.test_paged_attention import DEV

pytest.importorskip("triton")


def reference_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    was = fused_ops.FORCE
    fused_ops.FORCE = False
    try:
        return norm.to("cpu")(x.cpu())
    finally:
        fused_ops.FORCE = was


@pytest.mark.parametrize("shape", [(5, 64), (3, 9, 80)])
def test_rms_norm_equals_the_module(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=g))
    x = torch.randn(*shape, generator=g)
    want = reference_norm(norm, x)
    got = fused_ops.rms_norm(x.to(DEV), norm.weight.to(DEV), 1e-5)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_rms_norm_reads_a_strided_head_view() -> None:
    """Qwen3's per-head norms read q and k as views into the fused projection's rows."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(4, (6 + 2 * 2) * 16, generator=g)
    q = qkv[:, : 6 * 16].view(4, 6, 16)
    w = 1 + 0.1 * torch.randn(16, generator=g)
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    got = fused_ops.rms_norm(q.to(DEV), w.to(DEV), 1e-6)
    torch.testing.assert_close(got.cpu(), reference_norm(norm, q.contiguous()), atol=1e-5, rtol=0)


def test_silu_mul_equals_torch() -> None:
    g = torch.Generator().manual_seed(3)
    both = torch.randn(7, 2 * 1500, generator=g)  # more than one 1024-wide tile per row
    gate, up = both.chunk(2, dim=-1)
    got = fused_ops.silu_mul(both.to(DEV))
    torch.testing.assert_close(got.cpu(), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


def test_rope_store_rotates_and_stores_like_torch() -> None:
    g = torch.Generator().manual_seed(4)
    H, KV, hd, n = 4, 2, 32, 5
    cache = PagedKVCache(
        layers=1, num_blocks=12, block_size=16, kv_heads=KV, head_dim=hd,
        dtype=torch.float32, device=DEV,
    )  # fmt: skip
    tables: list[list[int]] = [[], []]
    spans = [rows_for(cache, tables[0], 0, 3, key=0), rows_for(cache, tables[1], 30, 2, key=1)]
    batch = build_batch(spans, 16, DEV)
    qkv = torch.randn(n, (H + 2 * KV) * hd, generator=g)
    q, k, v = qkv.split([H * hd, KV * hd, KV * hd], -1)
    q, k, v = q.view(n, H, hd), k.view(n, KV, hd), v.view(n, KV, hd)
    angles = torch.randn(n, hd // 2, generator=g)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    rq, rk = fused_ops.rope_store(
        q.to(DEV), k.to(DEV), v.to(DEV), cos.to(DEV), sin.to(DEV), cache.k[0], cache.v[0],
        batch.tables, batch.seq_index, batch.positions,
    )  # fmt: skip
    want_q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    torch.testing.assert_close(rq.cpu(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rk.cpu(), want_k, atol=1e-5, rtol=1e-5)
    expect = PagedKVCache(
        layers=1, num_blocks=12, block_size=16, kv_heads=KV, head_dim=hd,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    expect.write(0, want_k, v, build_batch(spans, 16, torch.device("cpu")))
    written = [(tables[0][0], t) for t in range(3)] + [(tables[1][1], t) for t in (14, 15)]
    for block, slot in written:  # (the rest of each block was never written in `expect`)
        for have, want in ((cache.k, expect.k), (cache.v, expect.v)):
            torch.testing.assert_close(have[0, :, block, slot].cpu(), want[0, :, block, slot])


def test_add_rms_norm_adds_then_normalises() -> None:
    g = torch.Generator().manual_seed(5)
    x, delta = torch.randn(6, 96, generator=g), torch.randn(6, 96, generator=g)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
    total, out = fused_ops.add_rms_norm(x.to(DEV), delta.to(DEV), norm.weight.to(DEV), 1e-5)
    torch.testing.assert_close(total.cpu(), x + delta)
    torch.testing.assert_close(out.cpu(), reference_norm(norm, x + delta), atol=1e-5, rtol=1e-5)
