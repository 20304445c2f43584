"""The kernels' decode attention (RoPE, optional q/k norm, KV-cache write, GQA softmax attention)
against torch, on the native and the scalar build. The cache holds IEEE halves: the reference
stores its keys and values through torch's fp32 -> fp16 rounding and attends in float64."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.kernels import Kernels
from services.worker.models.llama import LlamaConfig, LlamaModel, RMSNorm, rotate_half
from tests.worker_models import gen as _gen

torch.set_num_threads(1)

QK = 32


# ---- decode attention -------------------------------------------------------------------------

H, KV = 4, 2


def _rope_tables(hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables a real ``LlamaModel`` builds (64 positions)."""
    cfg = LlamaConfig(
        vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=H,
        num_kv_heads=KV, head_dim=hd, rope_theta=10000.0, context_length=64,
    )  # fmt: skip
    model = LlamaModel(cfg)
    return model.rope_cos.contiguous(), model.rope_sin.contiguous()


def _ref_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: list[int],
    slots: list[int],
    kc: torch.Tensor,
    vc: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
) -> torch.Tensor:
    """Torch decode attention; writes the roped key and raw value into ``kc``/``vc``."""
    hd = kc.shape[-1]
    out = []
    for b, (p, slot) in enumerate(zip(pos, slots, strict=True)):
        q, key, val = qkv[b].split([H * hd, KV * hd, KV * hd])
        q, key, val = q.view(H, hd), key.view(KV, hd), val.view(KV, hd)
        if q_norm is not None and k_norm is not None:
            q, key = q_norm(q), k_norm(key)
        q = q * cos[p] + rotate_half(q) * sin[p]
        key = key * cos[p] + rotate_half(key) * sin[p]
        kc[slot, :, p], vc[slot, :, p] = key, val
        keys, vals = kc[slot, :, : p + 1].double(), vc[slot, :, : p + 1].double()  # (KV, S, hd)
        heads = []
        for h in range(H):
            kv = h // (H // KV)
            att = (keys[kv] @ q[h].double()) / math.sqrt(hd)  # (S,)
            heads.append(att.softmax(-1) @ vals[kv])
        out.append(torch.cat(heads))
    return torch.stack(out).float()  # (B, H * hd)


@pytest.mark.parametrize("hd", [16, 64])  # 64: the kernel's register-blocked output path
@pytest.mark.parametrize("qwen3", [False, True], ids=["llama", "qk-norm"])
def test_attention_decode_matches_torch(k: Kernels, qwen3: bool, hd: int) -> None:
    g = _gen(200 + qwen3 + hd)
    cos, sin = _rope_tables(hd)
    n_slots, capacity, eps = 5, 24, 1e-6
    # Ragged (1 to 18 keys: whole and partial groups of 4 and 8), the slots neither sorted nor
    # contiguous.
    pos, slots = [6, 0, 17, 1, 8], [3, 0, 4, 1, 2]
    b = len(pos)
    qkv = torch.randn(b, (H + 2 * KV) * hd, generator=g) * 2
    kc = torch.randn(n_slots, KV, capacity, hd, generator=g).half()
    vc = torch.randn(n_slots, KV, capacity, hd, generator=g).half()
    # Positions after each row's token hold garbage the attention must not read.
    for p, slot in zip(pos, slots, strict=True):
        kc[slot, :, p + 1 :] = 1e4
        vc[slot, :, p + 1 :] = float("nan")
    q_norm = k_norm = None
    if qwen3:
        q_norm, k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
        with torch.no_grad():
            q_norm.weight.copy_(1.0 + 0.3 * torch.randn(hd, generator=g))
            k_norm.weight.copy_(1.0 + 0.3 * torch.randn(hd, generator=g))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    with torch.no_grad():
        want = _ref_attention(qkv, cos, sin, pos, slots, kc_ref, vc_ref, q_norm, k_norm)
    out = torch.full((b, H * hd), float("nan"))
    pos_t, slots_t = torch.tensor(pos), torch.tensor(slots)
    span = max(pos) + 1
    scores = torch.full((k.threads() * span,), float("nan"))  # the softmax scratch, per thread
    rows = qkv.clone()  # the kernel rotates q and k in place
    k.lib.sl_attention(
        b, 1, H, KV, hd, rows.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos_t.data_ptr(),
        slots_t.data_ptr(), kc.data_ptr(), vc.data_ptr(), capacity,
        0 if q_norm is None else q_norm.weight.data_ptr(),
        0 if k_norm is None else k_norm.weight.data_ptr(), eps, out.data_ptr(),
        scores.data_ptr(), span, k.threads(),
    )  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # The cache holds the roped key and the raw value at [slot, kv, pos]; nothing else moved.
    written = torch.zeros(n_slots, KV, capacity, dtype=torch.bool)
    for p, slot in zip(pos, slots, strict=True):
        written[slot, :, p] = True
    # the roped key, computed in fp32 by both, may round to the neighbouring half; the value is
    # stored as given, rounded the same way by both
    torch.testing.assert_close(kc[written], kc_ref[written], rtol=1e-3, atol=1e-6)
    assert torch.equal(vc[written], vc_ref[written])
    assert torch.equal(kc[~written], kc_ref[~written])
    assert torch.equal(vc[~written].nan_to_num(7.0), vc_ref[~written].nan_to_num(7.0))


@pytest.mark.parametrize("hd", [16, 64])
def test_attention_prefill_equals_decode_bit_for_bit(k: Kernels, hd: int) -> None:
    """T tokens in one call write the same keys and values and attend to the same bits as T
    one-token calls: prefill, prefix reuse and decode cannot tell a token apart."""
    g = _gen(300 + hd)
    cos, sin = _rope_tables(hd)
    starts, slots, T, capacity = [3, 0], [1, 0], 9, 24
    qkv = torch.randn(len(starts) * T, (H + 2 * KV) * hd, generator=g)
    kc0 = torch.randn(2, KV, capacity, hd, generator=g).half()  # before each start: cached
    vc0 = torch.randn(2, KV, capacity, hd, generator=g).half()
    span = max(starts) + T
    scores = torch.empty(k.threads() * span)

    def attend(
        first: list[int], where: list[int], t: int, rows: torch.Tensor, kc: torch.Tensor,
        vc: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Rows of t tokens from positions ``first`` in slots ``where``."""
        out = torch.empty(rows.shape[0], H * hd)
        starts_t, slots_t = torch.tensor(first), torch.tensor(where)
        k.lib.sl_attention(
            len(first), t, H, KV, hd, rows.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            starts_t.data_ptr(), slots_t.data_ptr(), kc.data_ptr(), vc.data_ptr(), capacity,
            0, 0, 1e-6, out.data_ptr(), scores.data_ptr(), span, k.threads(),
        )  # fmt: skip
        return out

    kc, vc = kc0.clone(), vc0.clone()
    whole = attend(starts, slots, T, qkv.clone(), kc, vc)
    kc1, vc1 = kc0.clone(), vc0.clone()
    steps = []
    for b, start in enumerate(starts):
        for t in range(T):
            row = qkv[b * T + t : b * T + t + 1].clone()
            steps.append(attend([start + t], [slots[b]], 1, row, kc1, vc1))
    assert torch.equal(whole, torch.cat(steps))
    assert torch.equal(kc, kc1) and torch.equal(vc, vc1)


def test_the_cache_rounds_like_torch_half(k: Kernels) -> None:
    """Values go into the cache rounded to nearest, ties to even, on every build (F16C's
    vcvtps2ph natively, ``float_to_half`` in the scalar build), exactly as torch's ``.half()``:
    normal values, ties, the subnormal range, overflow to infinity, signed zeros."""
    hd, capacity = 64, 4
    g = _gen(400)
    ulp = 2.0**-10  # a half's spacing in [1, 2)
    special = [1 + ulp / 2, 1 + 3 * ulp / 2, 2**-14, 2**-15 * 3, 2**-24, 2**-25, 2**-26,
               65504.0, 65519.0, 65520.0, 1e9, -0.0, 0.0, 6e-8, -3.1e-5]  # fmt: skip
    values = torch.cat([torch.tensor(special), torch.randn(hd * 8, generator=g) * 300])
    values = torch.cat([values, values * 2.0**-20])[: (values.numel() * 2 // hd) * hd]
    for at in range(0, values.numel(), hd):
        val = values[at : at + hd]
        qkv = torch.zeros(1, (H + 2 * KV) * hd)
        qkv[0, (H + KV) * hd : (H + KV + 1) * hd] = val  # the first KV head's value
        kc = torch.zeros(1, KV, capacity, hd, dtype=torch.half)
        vc = torch.zeros(1, KV, capacity, hd, dtype=torch.half)
        cos, sin = _rope_tables(hd)
        out = torch.empty(1, H * hd)
        scores = torch.empty(k.threads() * capacity)
        zero = torch.tensor([0])
        k.lib.sl_attention(
            1, 1, H, KV, hd, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), zero.data_ptr(),
            zero.data_ptr(), kc.data_ptr(), vc.data_ptr(), capacity, 0, 0, 1e-6, out.data_ptr(),
            scores.data_ptr(), 1, k.threads(),
        )  # fmt: skip
        want = val.half()
        assert torch.equal(vc[0, 0, 0].view(torch.int16), want.view(torch.int16))
