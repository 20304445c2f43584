"""The prefill GEMMs on AMX int8 tiles (``amx.c``) against the AVX-512 VNNI tiles they stand in
for: the same bits for every interleaved format, row count (one zero-padded tile, a full 16-row
tile, remainders, the default model's 190-token prompt) and shape (the 135M model's 576 / 1536 /
192, and an odd number of eight-row groups), and both within fp32 accumulation of float64 on
exact grids.

The VNNI side is the native build compiled with ``-DSL_NO_AMX``; the AMX side the process's
native build. Skipped where that build has no AMX (the CPU lacks amx_int8, or the OS refused
the tile state), with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker import kernels
from services.worker.kernels import FLAGS, Kernels, build
from services.worker.models.blocks import Q5_M, Q8_16, X8
from services.worker.models.kernel_llama import PackedLinear
from tests.unit.worker.test_kernels_formats import _activations, _assert_matmul, _grid
from tests.worker_models import gen

torch.set_num_threads(1)

ROWS = [8, 13, 16, 17, 31, 48, 190]  # from SL_AMX_MIN_M (8) rows: one padded tile, and more
# (N, K): the default model's q / o (576 x 576), gate / up (1536 x 576), down (576 x 1536), k / v
# (192 x 576), and 5 groups of eight rows (the last 16-row pair half empty) over 3 blocks
SHAPES = [(576, 576), (1536, 576), (576, 1536), (192, 576), (40, 96)]
K_SHAPES = [(576, 512), (192, 1536), (40, 256)]  # K-quants: K a multiple of 256
# each layout the AMX path covers: Q4 (Q4_0, Q4_1, Q4_K), Q5_M (Q5_*), Q8_0, Q8_16 (Q6_K)
QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K]
K_TYPES = {Q.Q4_K, Q.Q5_K, Q.Q6_K}


@pytest.fixture(scope="module")
def amx() -> Kernels:
    native = kernels.load()
    if native is None:
        pytest.skip("sluice CPU kernels cannot be built here")
    if not native.isa.endswith("+amx"):
        pytest.skip(f"no AMX int8 tiles in this build ({native.isa}): CPU or OS without them")
    return native


@pytest.fixture(scope="module")
def vnni(tmp_path_factory: pytest.TempPathFactory) -> Kernels:
    path = build(flags=[*FLAGS, "-DSL_NO_AMX"], directory=tmp_path_factory.mktemp("no-amx"))
    built = Kernels(path)
    assert built.isa == "avx512vnni"
    return built


def _cases() -> list[tuple[Q, int, int, int]]:
    cases = []
    for qtype in QTYPES:
        for n, kk in K_SHAPES if qtype in K_TYPES else SHAPES:
            cases += [(qtype, m, n, kk) for m in ROWS]
    return cases


@pytest.mark.parametrize(("qtype", "m", "n", "kk"), _cases())
def test_amx_gemm_is_the_vnni_gemm_bit_for_bit(
    amx: Kernels, vnni: Kernels, qtype: Q, m: int, n: int, kk: int
) -> None:
    blocks, w = _grid(qtype, n, kk, seed=m + n + int(qtype))
    bias = torch.randn(n, generator=gen(m))
    linear = PackedLinear(blocks, bias)
    assert linear.layout & X8 or linear.type in (int(Q.Q4_0), int(Q.Q4_1), Q5_M)
    a = _activations(m, kk, seed=300 + m)
    start = torch.randn(m, n, generator=gen(m + 1)) * 10
    got, want = start.clone(), start.clone()
    linear(amx, a, got, accumulate=True)
    linear(vnni, a, want, accumulate=True)
    assert torch.equal(got, want)
    _assert_matmul(got, a, w, bias + start)
    fresh = torch.full((m, n), float("nan"))
    linear(amx, a, fresh)  # without accumulate: every output written
    _assert_matmul(fresh, a, w, bias.expand(m, n))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q5_1, Q.Q6_K])
def test_amx_gemm_on_two_threads(amx: Kernels, vnni: Kernels, qtype: Q) -> None:
    """Two threads split the 16-row weight pairs (each with its own buffers and tile
    configuration): still the VNNI build's bits, single-threaded."""
    m, n, kk = 47, 200, 512  # 25 groups: the second thread's last pair is half empty
    blocks, _ = _grid(qtype, n, kk, seed=int(qtype))
    linear = PackedLinear(blocks, None)
    a = _activations(m, kk, seed=7)
    got, want = torch.empty(m, n), torch.empty(m, n)
    linear(vnni, a, want)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(3):  # threads keep their buffers between calls
            linear(amx, a, got)
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


def test_the_formats_cover_every_interleaved_layout() -> None:
    """Q4_0, Q4_1, Q5_M and the int8 layouts, so no format is left to the VNNI path unseen."""
    seen = {PackedLinear(_grid(q, 16, 512, seed=1)[0], None).type for q in QTYPES}
    assert seen == {int(Q.Q4_0), int(Q.Q4_1), Q5_M, int(Q.Q8_0), Q8_16}


def test_the_no_amx_build_has_no_warnings(tmp_path: Path) -> None:
    build(flags=[*FLAGS, "-DSL_NO_AMX", "-Werror"], directory=tmp_path)
