"""sluice's CPU kernels (``services/worker/kernels/*.c``) against exact torch references.

Every kernel runs twice: in the native build (``kernels.load()``: AVX2 + FMA where the CPU has
them) and in a portable build without ``-march=native`` (the scalar fallback loops). Matmuls take
weights exactly on a Q4_1 / Q8_0 grid and pre-quantized activations, so the only difference from
float64 math is fp32 accumulation. Attention: test_kernels_attention.py; the model built on
them: test_quantized_model.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.kernels import Kernels
from services.worker.kernels.tiles import tune_tiles
from services.worker.models.kernel_llama import (
    Activations,
    PackedLinear,
    pack_q4_1,
    pack_q8_0,
    unpack_q4_1,
)
from services.worker.models.llama import RMSNorm
from tests.worker_models import gen as _gen

torch.set_num_threads(1)

QK = 32


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


def test_gemm_tiles_of_8_and_16_weight_rows_give_the_same_bits(k: Kernels) -> None:
    """Which tile serves how many activation rows is measured per machine (``tune_tiles``),
    so it must never change a bit: every row count (one tile, several, a remainder; an odd
    last weight group) with 8-row tiles throughout, 16-row ones from two rows, and a switch
    in between."""
    n, kk = 40, 256
    _, d, mn, nibbles, _ = _q4_1_grid(n, kk, seed=90)
    try:
        for m in range(1, 19):
            a = _activations(m, kk, seed=100 + m)
            outputs = []
            for narrow in (1, 5, 18):
                k.lib.sl_set_narrow_rows(narrow)
                y = torch.full((m, n), float("nan"))
                _gemm_q4_1(k, a, nibbles, d, mn, None, y, accumulate=False)
                outputs.append(y)
            assert all(torch.equal(outputs[0], y) for y in outputs[1:]), m
    finally:
        k.lib.sl_set_narrow_rows(k.narrow_rows)


def test_the_tile_crossover_is_measured_on_avx512_builds_only(k: Kernels) -> None:
    try:
        rows = tune_tiles(k)
    finally:
        k.lib.sl_set_narrow_rows(k.narrow_rows)
    if k.isa.startswith("avx512"):
        assert 1 <= rows <= 16  # where the 16-row tile starts to win depends on the CPU
    else:
        assert rows == 1  # only the 8-row tile exists


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
