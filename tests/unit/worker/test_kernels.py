"""sluice's CPU kernels (``services/worker/kernels/*.c``) against exact torch references.

Every kernel runs twice: in the native build (``kernels.load()``: AVX2 + FMA where the CPU has
them) and in a portable build without ``-march=native`` (the scalar fallback loops). Matmuls take
weights exactly on a Q4_1 / Q8_0 grid and pre-quantized activations, so the only difference from
float64 math is fp32 accumulation; ``QuantizedLlama`` is then compared with the dense model it
wraps on each architecture.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker import kernels
from services.worker.kernels import Kernels, build
from services.worker.kv_cache import KVCache, build_batch
from services.worker.loaders import quantize_for_cpu
from services.worker.models.llama import LlamaConfig, LlamaModel, RMSNorm, rotate_half
from services.worker.models.quant import Int4Linear, Int8Linear
from services.worker.models.quantized import (
    Activations,
    PackedLinear,
    QuantizedLlama,
    pack_q4_1,
    pack_q8_0,
    supports,
    unpack_q4_1,
)
from tests.worker_models import ARCH_MODEL_TYPE, model_cache, random_model

torch.set_num_threads(1)

QK = 32
SCALAR_FLAGS = ["-O2", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
ARCHS = sorted(ARCH_MODEL_TYPE)
VOCAB = 256


@pytest.fixture(scope="module", params=["native", "scalar"])
def k(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Kernels:
    """The process-wide native build, then a portable scalar build in a fresh directory."""
    if request.param == "native":
        native = kernels.load()
        if native is None:
            pytest.skip("sluice CPU kernels cannot be built here")
        return native
    try:
        path = build(flags=SCALAR_FLAGS, directory=tmp_path_factory.mktemp("scalar-kernels"))
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"no C compiler for the scalar build: {exc}")
    scalar = Kernels(path)
    assert scalar.vectorized is False  # no -march=native: the scalar loops
    return scalar


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- references -------------------------------------------------------------------------------


def _ref_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M, K) fp32 -> unrounded x * inv (M, K), scales (M, K/32), rounded values (M, K)."""
    m, kk = x.shape
    blocks = x.view(m, kk // QK, QK)
    scale = blocks.abs().amax(-1) / 127.0  # fp32, like amax / 127.0f
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    v = blocks * inv[..., None]
    return v.view(m, kk), scale, torch.round(v).view(m, kk)  # round: half to even, like lrintf


def _assert_quantized(
    x: torch.Tensor, xq: torch.Tensor, xd: torch.Tensor, xs: torch.Tensor, *, exact: bool
) -> None:
    """``xq``/``xd``/``xs`` are the quantization of ``x``.

    ``exact``: ``x`` is bit-for-bit what the kernel quantized, so the scales are equal and a
    value may differ by one only within 1e-4 of a rounding tie. Otherwise ``x`` is a torch
    recomputation of the kernel's fp32 input (RMSNorm, SwiGLU): scales agree to 1e-5 and a value
    may differ by one only within 1e-2 of a tie.
    """
    m, kk = x.shape
    v, scale, q = _ref_quantize(x)
    if exact:
        assert torch.equal(xd, scale)
    else:
        torch.testing.assert_close(xd, scale, rtol=1e-5, atol=0.0)
    near_tie = ((v.abs() - v.abs().floor()) - 0.5).abs() < (1e-4 if exact else 1e-2)
    diff = (xq.float() - q).abs()
    assert diff.max().item() <= 1.0, f"a value is off by {diff.max().item()}"
    off = diff > 0
    assert not (off & ~near_tie).any(), f"values differ away from a tie at {off.nonzero()[:5]}"
    assert xq.abs().max().item() <= 127
    # The scaled block sums use the kernel's own values and scale.
    sums = xq.float().view(m, kk // QK, QK).sum(-1)
    assert torch.equal(xs, xd * sums)


def _q4_1_grid(n: int, kk: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Weights exactly on a Q4_1 grid (N a multiple of 8): values q (N, K) 0..15 spanning each
    block, scales d and minimums m (N, K/32), the kernel's interleaved layout (nibbles
    (N/8, K/32 * 128), scales and minimums (N/8, K/32, 8)), and w = d * q + m (fp32)."""
    g = _gen(seed)
    q = torch.randint(0, 16, (n, kk // QK, QK), generator=g)
    q[..., 0], q[..., 7] = 0, 15  # every block spans the whole range
    d = torch.rand(n, kk // QK, generator=g) * 0.1 + 0.01
    mn = torch.randn(n, kk // QK, generator=g) * 0.1
    w = (d[..., None] * q.float() + mn[..., None]).view(n, kk)
    nibbles, d8, mn8 = _interleave(q, d, mn)
    return q.view(n, kk), d8, mn8, nibbles, w


def _interleave(
    q: torch.Tensor, d: torch.Tensor, mn: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout sluice_cpu.h documents, written out element by element: for rows 8g..8g+7
    and block b, byte 32 j + 4 r + i = value 4 j + i of row r | value 16 + 4 j + i << 4."""
    n, nb = q.shape[0], q.shape[1]
    out = torch.zeros(n // 8, nb, 128, dtype=torch.uint8)
    for gi in range(n // 8):
        for b in range(nb):
            for j in range(4):
                for r in range(8):
                    for i in range(4):
                        row = q[8 * gi + r, b]
                        out[gi, b, 32 * j + 4 * r + i] = (
                            int(row[4 * j + i]) | int(row[16 + 4 * j + i]) << 4
                        )

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return t.view(n // 8, 8, nb).permute(0, 2, 1).contiguous()

    return out.view(n // 8, nb * 128), grouped(d), grouped(mn)


def _q8_0_grid(n: int, kk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights on a Q8_0 grid: values (N, K) int8 in -127..127 with both ends in each block,
    scales (N, K/32), w = d * q (fp32)."""
    g = _gen(seed)
    q = torch.randint(-127, 128, (n, kk // QK, QK), generator=g)
    q[..., 3], q[..., 20] = -127, 127
    d = torch.rand(n, kk // QK, generator=g) * 0.05 + 0.005
    w = (d[..., None] * q.float()).view(n, kk)
    return q.view(n, kk).to(torch.int8).contiguous(), d, w


def _activations(m: int, kk: int, seed: int) -> Activations:
    """Random already-quantized rows (values including the extremes +-127)."""
    g = _gen(seed)
    a = Activations(m, kk)
    a.q.copy_(torch.randint(-127, 128, (m, kk), generator=g).to(torch.int8))
    a.q[:, 0], a.q[:, 1] = 127, -127
    a.d.copy_(torch.rand(m, kk // QK, generator=g) * 0.05 + 0.001)
    a.s.copy_(a.d * a.q.float().view(m, kk // QK, QK).sum(-1))
    return a


def _dequantized(a: Activations) -> torch.Tensor:
    return (a.q.double().view(a.rows, -1, QK) * a.d.double()[..., None]).view(a.rows, a.width)


def _assert_matmul(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None = None
) -> None:
    """``got`` == x @ w.T (+ extra) up to fp32 accumulation: 1e-5 of the sum of |terms|."""
    want = x @ w.double().T
    if extra is not None:
        want = want + extra.double()
    magnitude = x.abs() @ w.double().abs().T + 1e-3
    err = (got.double() - want).abs() / magnitude
    assert err.max().item() < 1e-5, f"relative error {err.max().item():.3g}"


# ---- activation quantization ------------------------------------------------------------------


def test_quantize_matches_torch(k: Kernels) -> None:
    m, kk = 5, 128
    x = torch.randn(m, kk, generator=_gen(0)) * torch.tensor([0.01, 1.0, 30.0, 1e-4, 3.0])[:, None]
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    # A block with scale exactly 1 (amax 127): exact ties, rounded half to even.
    x[2, 64:96] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, 1.5, -2.5] + [0.25] * 24)
    out = Activations(m, kk)
    out.q.fill_(99), out.d.fill_(9.0), out.s.fill_(9.0)  # every value must be overwritten
    k.quantize(x, out)
    xq, xd, xs = out.q, out.d, out.s
    _assert_quantized(x, xq, xd, xs, exact=True)
    assert xq[2, 64:72].tolist() == [127, 2, 4, 0, -2, 0, 2, -2]  # half to even, not away
    assert torch.equal(xq[1, 32:64], torch.zeros(32, dtype=torch.int8))
    assert xd[1, 1].item() == 0.0 and xs[1, 1].item() == 0.0
    assert xd[2, 2].item() == 1.0


def test_quantize_single_row_matches_torch(k: Kernels) -> None:
    x = torch.randn(1, 64, generator=_gen(1)) * 5
    out = Activations(1, 64)
    k.quantize(x, out)
    xq, xd, xs = out.q, out.d, out.s
    _assert_quantized(x, xq, xd, xs, exact=True)


def test_rmsnorm_quantize_matches_torch_rmsnorm(k: Kernels) -> None:
    m, kk, eps = 3, 96, 1e-5
    g = _gen(2)
    x = torch.randn(m, kk, generator=g) * torch.tensor([0.1, 1.0, 50.0])[:, None]
    norm = RMSNorm(kk, eps)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(kk, generator=g))
        want = norm(x)
    a = Activations(m, kk)
    k.lib.sl_rmsnorm_quantize(
        x.data_ptr(), norm.weight.data_ptr(), eps, m, kk, a.q.data_ptr(), a.d.data_ptr(),
        a.s.data_ptr(), a.tmp.data_ptr(), k.threads(),
    )  # fmt: skip
    torch.testing.assert_close(a.tmp, want, rtol=1e-5, atol=1e-6)  # the normalized floats
    _assert_quantized(a.tmp, a.q, a.d, a.s, exact=True)  # what the kernel quantized
    _assert_quantized(want, a.q, a.d, a.s, exact=False)  # == quantize(RMSNorm(x) * w)


def test_swiglu_quantize_matches_silu_times_up(k: Kernels) -> None:
    m, inner = 3, 64
    g = _gen(3)
    gu = torch.randn(m, 2 * inner, generator=g) * 4
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    a = Activations(m, inner)
    k.lib.sl_swiglu_quantize(
        gu.data_ptr(), m, inner, a.q.data_ptr(), a.d.data_ptr(), a.s.data_ptr(),
        a.tmp.data_ptr(), k.threads(),
    )  # fmt: skip
    torch.testing.assert_close(a.tmp, want, rtol=1e-5, atol=1e-6)
    _assert_quantized(a.tmp, a.q, a.d, a.s, exact=True)
    _assert_quantized(want, a.q, a.d, a.s, exact=False)


# ---- quantized matmuls ------------------------------------------------------------------------


def _gemm_q4_1(
    k: Kernels,
    a: Activations,
    nibbles: torch.Tensor,
    d: torch.Tensor,
    mn: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    accumulate: bool,
) -> None:
    n = nibbles.shape[0] * 8
    k.lib.sl_gemm_q4_1(
        a.rows, n, a.width, a.q.data_ptr(), a.d.data_ptr(), a.s.data_ptr(), nibbles.data_ptr(),
        d.data_ptr(), mn.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
        int(accumulate), k.threads(),
    )  # fmt: skip


@pytest.mark.parametrize("m", range(1, 10))
def test_gemm_q4_1_on_grid_equals_float_math(k: Kernels, m: int) -> None:
    n, kk = 40, 96
    _, d, mn, nibbles, w = _q4_1_grid(n, kk, seed=10 + m)
    a = _activations(m, kk, seed=20 + m)
    x = _dequantized(a)
    y = torch.full((m, n), float("nan"))
    _gemm_q4_1(k, a, nibbles, d, mn, None, y, accumulate=False)
    _assert_matmul(y, x, w)


@pytest.mark.parametrize("m", [1, 4, 7])
def test_gemm_q4_1_bias_and_accumulate(k: Kernels, m: int) -> None:
    n, kk = 24, 256
    _, d, mn, nibbles, w = _q4_1_grid(n, kk, seed=30 + m)
    a = _activations(m, kk, seed=40 + m)
    x = _dequantized(a)
    bias = torch.randn(n, generator=_gen(5))
    y = torch.full((m, n), float("nan"))
    _gemm_q4_1(k, a, nibbles, d, mn, bias, y, accumulate=False)
    _assert_matmul(y, x, w, bias)
    start = torch.randn(m, n, generator=_gen(6)) * 10
    y = start.clone()
    _gemm_q4_1(k, a, nibbles, d, mn, bias, y, accumulate=True)
    _assert_matmul(y, x, w, bias + start)
    y = start.clone()
    _gemm_q4_1(k, a, nibbles, d, mn, None, y, accumulate=True)
    _assert_matmul(y, x, w, start)


def _gemm_q8_0(
    k: Kernels,
    a: Activations,
    wq: torch.Tensor,
    d: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    accumulate: bool,
) -> None:
    k.lib.sl_gemm_q8_0(
        a.rows, wq.shape[0], a.width, a.q.data_ptr(), a.d.data_ptr(), wq.data_ptr(), d.data_ptr(),
        0 if bias is None else bias.data_ptr(), y.data_ptr(), int(accumulate), k.threads(),
    )  # fmt: skip


@pytest.mark.parametrize("m", range(1, 10))
def test_gemm_q8_0_on_grid_equals_float_math(k: Kernels, m: int) -> None:
    n, kk = 40, 96
    wq, d, w = _q8_0_grid(n, kk, seed=50 + m)
    a = _activations(m, kk, seed=60 + m)
    y = torch.full((m, n), float("nan"))
    _gemm_q8_0(k, a, wq, d, None, y, accumulate=False)
    _assert_matmul(y, _dequantized(a), w)


@pytest.mark.parametrize("m", [1, 5, 8])
def test_gemm_q8_0_bias_and_accumulate(k: Kernels, m: int) -> None:
    n, kk = 33, 128
    wq, d, w = _q8_0_grid(n, kk, seed=70 + m)
    a = _activations(m, kk, seed=80 + m)
    x = _dequantized(a)
    bias = torch.randn(n, generator=_gen(7))
    y = torch.full((m, n), float("nan"))
    _gemm_q8_0(k, a, wq, d, bias, y, accumulate=False)
    _assert_matmul(y, x, w, bias)
    start = torch.randn(m, n, generator=_gen(8)) * 10
    y = start.clone()
    _gemm_q8_0(k, a, wq, d, bias, y, accumulate=True)
    _assert_matmul(y, x, w, bias + start)


def test_packed_linear_matches_dense_linear_on_grid(k: Kernels) -> None:
    m, n, kk = 6, 48, 64
    *_, w = _q4_1_grid(n, kk, seed=90)
    bias = torch.randn(n, generator=_gen(9))
    a = _activations(m, kk, seed=91)
    y = torch.empty(m, n)
    PackedLinear(w, bias, "q4_1")(k, a, y)
    _assert_matmul(y, _dequantized(a), w, bias)
    _, _, w8 = _q8_0_grid(n, kk, seed=92)
    PackedLinear(w8, None, "q8_0")(k, a, y)
    _assert_matmul(y, _dequantized(a), w8)


# ---- packing ----------------------------------------------------------------------------------


def test_pack_q4_1_round_trips_grid_weights() -> None:
    n, kk = 24, 128
    _, d, mn, nibbles, w = _q4_1_grid(n, kk, seed=100)
    packed, scale, lo = pack_q4_1(w)
    assert packed.shape == (n // 8, kk // QK * 128) and packed.dtype == torch.uint8
    assert scale.shape == lo.shape == (n // 8, kk // QK, 8)
    assert torch.equal(packed, nibbles)
    assert torch.equal(lo, mn)  # the minimum is the q = 0 weight, exactly
    torch.testing.assert_close(scale, d, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(unpack_q4_1(packed, scale, lo), w, rtol=0.0, atol=1e-6)


def test_pack_q4_1_constant_block_is_its_minimum() -> None:
    w = torch.full((8, 32), 0.75)
    packed, scale, lo = pack_q4_1(w)
    assert torch.equal(scale, torch.zeros(1, 1, 8)) and torch.equal(lo, torch.full((1, 1, 8), 0.75))
    assert torch.equal(packed, torch.zeros(1, 128, dtype=torch.uint8))


def test_pack_q8_0_round_trips_grid_weights() -> None:
    n, kk = 20, 96
    q, d, w = _q8_0_grid(n, kk, seed=101)
    packed, scale = pack_q8_0(w)
    assert packed.shape == (n, kk) and packed.dtype == torch.int8
    assert torch.equal(packed, q)
    torch.testing.assert_close(scale, d, rtol=1e-6, atol=0.0)
    again = (packed.float().view(n, -1, QK) * scale[..., None]).view(n, kk)
    torch.testing.assert_close(again, w, rtol=1e-6, atol=1e-7)


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
    kc = torch.randn(n_slots, KV, capacity, hd, generator=g)
    vc = torch.randn(n_slots, KV, capacity, hd, generator=g)
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
    scores = torch.full((b * H * span,), float("nan"))  # the kernel's softmax scratch
    rows = qkv.clone()  # the kernel rotates q and k in place
    k.lib.sl_attention_decode(
        b, H, KV, hd, rows.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos_t.data_ptr(),
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
    torch.testing.assert_close(kc[written], kc_ref[written], rtol=1e-5, atol=1e-6)
    assert torch.equal(vc[written], vc_ref[written])
    assert torch.equal(kc[~written], kc_ref[~written])
    assert torch.equal(vc[~written].nan_to_num(7.0), vc_ref[~written].nan_to_num(7.0))


# ---- QuantizedLlama vs the dense model --------------------------------------------------------


def _snap_to_grid(model: LlamaModel) -> None:
    """Move the block linears onto the Q4_1 grid and the head onto the Q8_0 grid (in place), so
    the dense model computes exactly with the weights ``QuantizedLlama`` packs."""
    with torch.no_grad():
        for block in model.layers:
            for linear in (
                block.self_attn.qkv,
                block.self_attn.o_proj,
                block.mlp.gate_up,
                block.mlp.down_proj,
            ):
                w = linear.weight
                w.copy_(unpack_q4_1(*pack_q4_1(w)))
        head = model.lm_head.weight
        q, scale = pack_q8_0(head)
        head.copy_((q.float().view(head.shape[0], -1, QK) * scale[..., None]).view_as(head))


def _decode_cache(model: nn.Module) -> KVCache:
    return model_cache(model, slots=4, initial=32)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_llama_tracks_the_dense_model(k: Kernels, arch: str) -> None:
    dense = random_model(arch, VOCAB, seed=11)
    _snap_to_grid(dense)
    assert supports(dense)
    wrapped = random_model(arch, VOCAB, seed=11)  # the same weights: QuantizedLlama owns this one
    _snap_to_grid(wrapped)
    quantized = QuantizedLlama(wrapped, k)
    g = _gen(300)
    slots, lengths = [2, 0, 3], [7, 3, 12]  # ragged rows in non-contiguous slots
    prompts = [torch.randint(0, VOCAB, (1, t), generator=g) for t in lengths]
    caches = [_decode_cache(dense), _decode_cache(dense)]
    last = []
    with torch.inference_mode():
        for slot, ids in zip(slots, prompts, strict=True):
            batch = build_batch([slot], [0], ids.shape[1], torch.device("cpu"))
            want = dense(ids, batch, caches[0], n_logits=ids.shape[1])
            got = quantized(ids, batch, caches[1], n_logits=ids.shape[1])
            # Prefill (T > 1) runs the same kernels (8-bit activations) around torch attention.
            assert ((got - want).abs().max() / want.abs().max()).item() < 0.02
            last.append(want[0, -1])
        tokens = torch.stack(last).argmax(-1, keepdim=True)  # (3, 1)
        starts = list(lengths)
        worst = 0.0
        for _ in range(5):
            batch = build_batch(slots, starts, 1, torch.device("cpu"))
            want = dense(tokens, batch, caches[0])
            got = quantized(tokens, batch, caches[1])
            assert got.shape == want.shape == (3, 1, VOCAB) and got.dtype == torch.float32
            rel = ((got - want).abs().max() / want.abs().max()).item()
            worst = max(worst, rel)
            tokens = want[:, 0].argmax(-1, keepdim=True)  # both models see the same tokens
            starts = [s + 1 for s in starts]
    # On-grid weights leave 8-bit activations as the only loss: measured below 1 %.
    assert worst < 0.02, f"decode logits differ by {worst:.2%} of the largest logit"
    # The decode steps wrote the same keys and values (up to 8-bit activations).
    for cache in caches:
        assert cache.capacity == 32
    for slot, end in zip(slots, starts, strict=True):
        for a, b in ((caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):
            got, want = a[:, slot, :, :end], b[:, slot, :, :end]
            assert ((got - want).abs().max() / want.abs().max()).item() < 0.03
    untouched = [s for s in range(4) if s not in slots]
    assert not caches[1].k[:, untouched].any() and not caches[1].v[:, untouched].any()


# ---- build and fallback -----------------------------------------------------------------------


def test_build_with_a_missing_compiler_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    out = tmp_path / "cache"
    with pytest.raises(RuntimeError):
        build(directory=out)
    assert not list(out.glob("*.so"))  # no half-built or empty library left behind


def test_build_with_a_failing_compiler_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", "false")
    out = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="failed"):
        build(directory=out)
    assert not list(out.glob("*.so"))


def test_build_is_cached(tmp_path: Path) -> None:
    first = build(flags=SCALAR_FLAGS, directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build(flags=SCALAR_FLAGS, directory=tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert build(flags=[*SCALAR_FLAGS, "-DX=1"], directory=tmp_path) != first  # flags are keyed


def test_quantize_for_cpu_without_kernels_falls_back_to_torch_int4() -> None:
    model = random_model("LlamaForCausalLM", VOCAB, seed=4)
    ready = quantize_for_cpu(model, None)
    assert ready is model
    assert isinstance(model.layers[0].mlp.gate_up, Int4Linear)
    assert isinstance(model.layers[1].self_attn.qkv, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear)


def test_quantize_for_cpu_picks_the_kernels_only_when_vectorized(k: Kernels) -> None:
    model = random_model("Qwen2ForCausalLM", VOCAB, seed=5)
    ready = quantize_for_cpu(model, k)
    if k.vectorized:
        assert isinstance(ready, QuantizedLlama) and ready.model is model
        assert model.layers[0].mlp.gate_up.weight.numel() == 0  # dense weights released
    else:  # the scalar loops are slower than torch's int4 kernels
        assert ready is model and isinstance(model.layers[0].mlp.gate_up, Int4Linear)


def test_quantize_for_cpu_falls_back_when_widths_do_not_split_into_blocks(k: Kernels) -> None:
    model = random_model("LlamaForCausalLM", VOCAB, seed=6, intermediate_size=80)
    assert not supports(model)
    ready = quantize_for_cpu(model, k)
    assert ready is model and isinstance(model.layers[0].self_attn.qkv, Int4Linear)
