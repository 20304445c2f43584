"""The GGUF weight formats the CPU kernels read exactly (Q4_0, Q4_1, Q8_0, and Q4_K as Q4_1
blocks): packing raw blocks against the ``gguf`` package's reference dequantization, each
format's GEMM / GEMV on an exact grid against float64 (native, AVX2 and scalar builds), and tiny
models written as each format against the dense model's logits."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker.kernels import (
    FLAGS,
    MIRRORS,
    BlockQ4_0,
    BlockQ4_1,
    BlockQ8_0,
    Kernels,
    build,
)
from services.worker.models.blocks import (
    BLOCK_BYTES,
    H16,
    Q5_M,
    Q8_16,
    Q8_M,
    X8,
    QuantBlocks,
    dequantize_blocks,
    pack_blocks,
)
from services.worker.models.kernel_llama import Activations, PackedLinear
from tests.worker_models import (
    gen,
    quantize_q4_k,
)

torch.set_num_threads(1)

QK = 32
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]  # gguf-py writes these (and Q5_0 / Q5_1)


def _blocks(a: np.ndarray, qtype: Q) -> QuantBlocks:
    raw = gguf.quants.quantize(a, qtype)
    n, k = a.shape
    return QuantBlocks(int(qtype), torch.from_numpy(raw.copy()).view(n, -1), (n, k))


def _unpacked(b: QuantBlocks) -> torch.Tensor:
    """The (N, K) weights the kernel's layout holds, read back from ``pack_blocks``' output."""
    fmt, q, d, m = pack_blocks(b)
    n, k = b.shape
    nb = k // QK
    if fmt == Q8_16:
        return (q.float().view(n, 2 * nb, 16) * d[..., None]).view(n, k)
    if q.dtype == torch.int8:  # Q8_0, Q8_M
        w = q.float().view(n, nb, QK) * d[..., None]
        return (w if m is None else w + m[..., None]).view(n, k)
    g = n // 8
    by = q.view(g, nb, 4, 8, 4).permute(0, 1, 3, 2, 4)  # (G, nb, row, j, i)
    v = torch.cat([(by & 0x0F).reshape(g, nb, 8, 16), (by >> 4).reshape(g, nb, 8, 16)], -1)
    low = -8.0 * d if m is None else m
    w = v.float() * d[..., None] + low[..., None]  # (G, nb, row, 32)
    return w.permute(0, 2, 1, 3).reshape(n, k)


@pytest.mark.parametrize("qtype", FORMATS)
def test_packed_blocks_hold_what_gguf_dequantizes(qtype: Q) -> None:
    a = np.random.default_rng(int(qtype)).standard_normal((24, 96)).astype(np.float32)
    b = _blocks(a, qtype)
    want = gguf.quants.dequantize(b.data.numpy(), qtype).reshape(24, 96)
    assert np.array_equal(dequantize_blocks(b).numpy(), want)
    assert np.array_equal(_unpacked(b).numpy(), want)


# where each type keeps its f16 halves, and how many values a block holds
HALVES = {Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
ALL_HALVES = {**HALVES, Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0]}


def _random_blocks(qtype: Q, n: int, kk: int, seed: int) -> QuantBlocks:
    """Blocks of random bytes (every byte pattern is valid) with small finite halves."""
    g = gen(seed)
    per = 256 if qtype in K_TYPES else QK
    raw = torch.randint(0, 256, (n, kk // per, BLOCK_BYTES[int(qtype)]), generator=g)
    raw = raw.to(torch.uint8)
    for at in ALL_HALVES[qtype]:
        half = (torch.rand(n, kk // per, 1, generator=g) * 0.004 + 0.0005).half()
        raw[..., at : at + 2] = half.view(torch.uint8)
    return QuantBlocks(int(qtype), raw.view(n, -1), (n, kk))


@pytest.mark.parametrize(
    ("qtype", "fmt"),
    [(Q.Q5_0, Q8_M), (Q.Q5_1, Q8_M), (Q.Q4_K, Q.Q4_1), (Q.Q5_K, Q8_M), (Q.Q6_K, Q8_16)],
)
def test_5_and_6_bit_and_k_quant_blocks_pack_exactly(qtype: Q, fmt: int) -> None:
    b = _random_blocks(qtype, 16, 512, seed=int(qtype))
    want = gguf.quants.dequantize(b.data.numpy(), qtype).reshape(16, 512)
    assert np.array_equal(dequantize_blocks(b).numpy(), want)
    assert pack_blocks(b)[0] == int(fmt)
    assert np.array_equal(_unpacked(b).numpy(), want)


@pytest.mark.parametrize(
    ("types", "fmt"),
    [
        ((Q.Q4_0, Q.Q5_0, Q.Q4_K), Q8_M),  # unsigned values with minimums
        ((Q.Q5_1, Q.Q4_1, Q.Q5_K), Q8_M),
        ((Q.Q5_0, Q.Q5_0, Q.Q8_0), Q.Q8_0),  # signed, no minimums
        ((Q.Q8_0, Q.Q6_K, Q.Q4_0), Q8_16),
        ((Q.Q4_1, Q.Q8_0), None),  # a minimum beside signed values: no common format
    ],
)
def test_fused_parts_of_different_types_pack_exactly(types: tuple[Q, ...], fmt: int | None) -> None:
    parts = [_random_blocks(t, 8 * (i + 1), 512, seed=i) for i, t in enumerate(types)]
    fused = QuantBlocks.cat(parts)
    if fmt is None:
        assert fused is None
        return
    assert fused is not None and fused.shape == (sum(p.shape[0] for p in parts), 512)
    want = np.concatenate(
        [
            gguf.quants.dequantize(p.data.numpy(), t).reshape(p.shape)
            for p, t in zip(parts, types, strict=True)
        ]
    )
    assert pack_blocks(fused)[0] == int(fmt)
    assert np.array_equal(_unpacked(fused).numpy(), want)
    assert np.array_equal(dequantize_blocks(fused).numpy(), want)


def test_the_test_q4_k_writer_is_what_gguf_reads() -> None:
    a = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
    written = QuantBlocks(int(Q.Q4_K), torch.from_numpy(quantize_q4_k(a)), (8, 256))
    reference = gguf.quants.dequantize(written.data.numpy(), Q.Q4_K).reshape(8, 256)
    assert np.array_equal(_unpacked(written).numpy(), reference)
    assert np.abs(reference - a).max() < 0.1 * np.abs(a).max()  # the test quantizer is sane


def _grid(qtype: Q, n: int, kk: int, seed: int) -> tuple[QuantBlocks, torch.Tensor]:
    """Raw GGUF blocks with every value of each block's grid used, and the fp32 weights."""
    g = gen(seed)
    nb = kk // QK
    if qtype in HALVES:
        blocks = _random_blocks(qtype, n, kk, seed)
        return blocks, dequantize_blocks(blocks)
    d = (torch.rand(n, nb, generator=g) * 0.1 + 0.01).half()
    if qtype == Q.Q8_0:
        q = torch.randint(-127, 128, (n, nb, QK), generator=g)
        q[..., 3], q[..., 20] = -127, 127
        w = d.float()[..., None] * q.float()
        body = q.to(torch.int8).view(torch.uint8)
        raw = torch.cat([d[..., None].view(torch.uint8), body], -1)
    else:
        q = torch.randint(0, 16, (n, nb, QK), generator=g)
        q[..., 0], q[..., 31] = 0, 15
        packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        parts = [d[..., None].view(torch.uint8)]
        if qtype == Q.Q4_0:
            w = d.float()[..., None] * (q.float() - 8.0)
        else:
            m = (torch.randn(n, nb, generator=g) * 0.1).half()
            w = d.float()[..., None] * q.float() + m.float()[..., None]
            parts.append(m[..., None].view(torch.uint8))
        raw = torch.cat([*parts, packed], -1)
    return QuantBlocks(int(qtype), raw.reshape(n, -1).contiguous(), (n, kk)), w.view(n, kk)


def _activations(m: int, kk: int, seed: int) -> Activations:
    g = gen(seed)
    a = Activations(m, kk)
    a.q.copy_(torch.randint(-127, 128, (m, kk), generator=g).to(torch.int8))
    a.q[:, 0], a.q[:, 1] = 127, -127
    a.d.copy_(torch.rand(m, kk // QK, generator=g) * 0.05 + 0.001)
    a.s.copy_(a.d * a.q.float().view(m, kk // QK, QK).sum(-1))
    return a


def _assert_matmul(got: torch.Tensor, a: Activations, w: torch.Tensor, extra: torch.Tensor) -> None:
    """``got`` == x @ w.T + extra up to fp32 accumulation: 1e-5 of the sum of |terms|."""
    x = (a.q.double().view(a.rows, -1, QK) * a.d.double()[..., None]).view(a.rows, a.width)
    want = x @ w.double().T + extra.double()
    magnitude = x.abs() @ w.double().abs().T + 1e-3
    err = (got.double() - want).abs() / magnitude
    assert err.max().item() < 1e-5, f"relative error {err.max().item():.3g}"


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("qtype", [*FORMATS, *HALVES])
def test_gemm_on_grid_equals_float_math(k: Kernels, qtype: Q, m: int) -> None:
    n, kk = 40, 256
    blocks, w = _grid(qtype, n, kk, seed=m + 10 * int(qtype))
    assert torch.equal(dequantize_blocks(blocks), w)
    bias = torch.randn(n, generator=gen(m))
    linear = PackedLinear(blocks, bias)
    fmt = pack_blocks(blocks)[0]
    assert linear.type == (Q5_M if fmt == Q8_M else fmt)  # n % 8 == 0: 5-bit values in 5 bits
    a = _activations(m, kk, seed=100 + m)
    y = torch.full((m, n), float("nan"))
    linear(k, a, y)
    _assert_matmul(y, a, w, bias.expand(m, n))
    start = torch.randn(m, n, generator=gen(m + 1)) * 10
    y = start.clone()
    linear(k, a, y, accumulate=True)
    _assert_matmul(y, a, w, bias + start)


@pytest.mark.parametrize("m", [1, 4, 6])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_1, Q.Q8_0])
def test_gemm_largest_values_do_not_saturate(k: Kernels, qtype: Q, m: int) -> None:
    """Every weight at its grid's top (15, 31, 127) against activations all 127 or all -127: the
    int16 partial sums of the AVX2 tiles sit closest to their limit (30480, 31496, 32258)."""
    n, kk = 16, 256
    blocks = _random_blocks(qtype, n, kk, seed=7)
    raw = blocks.data.view(n, kk // QK, -1)
    halves = ALL_HALVES[qtype]
    values_at = max(halves) + 2  # the bytes after the halves: bits and nibbles, or int8 values
    raw[..., values_at:] = 0xFF if qtype != Q.Q8_0 else 127  # Q5_1: fifth bits all set too
    w = dequantize_blocks(blocks)
    a = _activations(m, kk, seed=9)
    a.q.copy_(torch.where(torch.arange(m)[:, None] % 2 == 0, 127, -127).expand(m, kk))
    a.s.copy_(a.d * a.q.float().view(m, kk // QK, QK).sum(-1))
    y = torch.full((m, n), float("nan"))
    PackedLinear(blocks, None)(k, a, y)
    _assert_matmul(y, a, w, torch.zeros(m, n))


@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K])
def test_int8_formats_row_by_row_and_interleaved(k: Kernels, qtype: Q, m: int) -> None:
    """Eight rows interleaved when N % 8 == 0 (the 5-bit types as Q5_M: 160 bytes per eight
    rows' block), else row by row: the same products. Interleaved, the types whose scales are
    the blocks' own f16 fields keep them as halves (H16); the K-quants' products cannot; Q5_0's
    minimums are left to the kernels."""
    for n in (36, 48):
        blocks, w = _grid(qtype, n, 256, seed=m + n)
        linear = PackedLinear(blocks, None)
        layout = linear.layout & ~H16
        if qtype in (Q.Q5_0, Q.Q5_1, Q.Q5_K) and n % 8 == 0:
            assert layout == Q5_M and linear.q.numel() == n // 8 * (256 // QK) * 160
        else:
            assert bool(layout & X8) == (n % 8 == 0)
        halves = n % 8 == 0 and qtype in (Q.Q8_0, Q.Q5_0, Q.Q5_1)
        assert bool(linear.layout & H16) == halves
        assert linear.d.dtype == (torch.float16 if halves else torch.float32)
        if layout == Q5_M:  # Q5_0's minimums (-16 d) are implied, the others' stored
            assert (linear.m is None) == (qtype == Q.Q5_0)
        a = _activations(m, 256, seed=200 + m)
        y = torch.full((m, n), float("nan"))
        linear(k, a, y)
        _assert_matmul(y, a, w, torch.zeros(m, n))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.Q8_0, Q.Q6_K])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(k: Kernels, qtype: Q) -> None:
    """Each activation row's products are the bits it gets alone, whatever rows share the call:
    what makes a speculative draft's rows and a batch's decode rows give a lone stream's tokens.
    With AVX-512 one row runs on the 8-row tiles and more on the 16-row ones (two groups per
    vector), with 1-8 rows per weight pass; 40 rows of weights hold two pairs and an odd group."""
    n, kk = 40, 256
    blocks = _random_blocks(qtype, n, kk, seed=7) if qtype in HALVES else _grid(qtype, n, kk, 7)[0]
    linear = PackedLinear(blocks, torch.randn(n, generator=gen(3)))
    a = _activations(11, kk, seed=300)
    alone = torch.empty(11, n)
    for i in range(11):
        one = Activations(1, kk)
        one.q.copy_(a.q[i : i + 1]), one.d.copy_(a.d[i : i + 1]), one.s.copy_(a.s[i : i + 1])
        linear(k, one, alone[i : i + 1])
    for m in (2, 5, 8, 9, 11):
        part = Activations(m, kk)
        part.q.copy_(a.q[:m]), part.d.copy_(a.d[:m]), part.s.copy_(a.s[:m])
        y = torch.empty(m, n)
        linear(k, part, y)
        assert torch.equal(y, alone[:m]), f"{m} rows"


def test_gemm_q4_0_entry_point(k: Kernels) -> None:
    m, n, kk = 5, 16, 64
    blocks, w = _grid(Q.Q4_0, n, kk, seed=3)
    _, nibbles, d, _ = pack_blocks(blocks)
    a = _activations(m, kk, seed=4)
    y = torch.full((m, n), float("nan"))
    k.lib.sl_gemm_q4_0(
        m, n, kk, a.q.data_ptr(), a.d.data_ptr(), a.s.data_ptr(), nibbles.data_ptr(),
        d.data_ptr(), 0, y.data_ptr(), 0, k.threads(),
    )  # fmt: skip
    _assert_matmul(y, a, w, torch.zeros(m, n))


# ---- the ABI: warnings, struct sizes ----------------------------------------------------------


def test_native_build_has_no_warnings(tmp_path: Path) -> None:
    build(flags=[*FLAGS, "-Werror"], directory=tmp_path)  # FLAGS has -Wall -Wextra ...


def test_struct_sizes_match_their_ctypes_mirrors(k: Kernels) -> None:
    for name, mirror in MIRRORS.items():
        assert k.lib.sl_sizeof(name.encode()) == ctypes.sizeof(mirror), name
    assert k.lib.sl_sizeof(b"sl_nothing") == -1
    assert [ctypes.sizeof(m) for m in (BlockQ4_0, BlockQ4_1, BlockQ8_0)] == [18, 20, 34]


def test_a_mirror_of_the_wrong_size_fails_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    class Short(ctypes.Structure):
        _fields_ = [("q", ctypes.c_void_p)]

    monkeypatch.setitem(MIRRORS, "sl_linear", Short)
    with pytest.raises(RuntimeError, match="sl_linear is 56 bytes"):
        Kernels(build())


# ---- tiny models written as each format -------------------------------------------------------
