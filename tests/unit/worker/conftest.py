"""Worker test fixtures: ``k``, the CPU kernels, as the native build (AVX-512 VNNI where the CPU
has it), an AVX2-only build (where the CPU has AVX2) and a portable scalar build."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker import kernels
from services.worker.kernels import Kernels, build
from tests.worker_models import AVX2_KERNEL_FLAGS, SCALAR_KERNEL_FLAGS


def _has_avx2() -> bool:
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return False
    return all(f" {flag} " in f" {flags} " for flag in ("avx2", "fma", "f16c"))


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def k(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Kernels:
    """The process-wide native build, then an AVX2-only and a portable scalar build in fresh
    directories."""
    if request.param == "native":
        native = kernels.load()
        if native is None:
            pytest.skip("sluice CPU kernels cannot be built here")
        return native
    if request.param == "avx2" and not _has_avx2():
        pytest.skip("no AVX2 on this CPU")
    flags = AVX2_KERNEL_FLAGS if request.param == "avx2" else SCALAR_KERNEL_FLAGS
    try:
        path = build(flags=flags, directory=tmp_path_factory.mktemp(f"{request.param}-kernels"))
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"no C compiler for the {request.param} build: {exc}")
    built = Kernels(path)
    assert built.isa == request.param  # the variant the flags ask for
    return built
