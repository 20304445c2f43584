"""Worker test fixtures: ``k``, the CPU kernels, as the native and as a portable scalar build."""

from __future__ import annotations

import pytest

from services.worker import kernels
from services.worker.kernels import Kernels, build
from tests.worker_models import SCALAR_KERNEL_FLAGS


@pytest.fixture(scope="module", params=["native", "scalar"])
def k(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Kernels:
    """The process-wide native build, then a portable scalar build in a fresh directory."""
    if request.param == "native":
        native = kernels.load()
        if native is None:
            pytest.skip("sluice CPU kernels cannot be built here")
        return native
    try:
        path = build(flags=SCALAR_KERNEL_FLAGS, directory=tmp_path_factory.mktemp("scalar-kernels"))
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"no C compiler for the scalar build: {exc}")
    scalar = Kernels(path)
    assert scalar.vectorized is False  # no -march=native: the scalar loops
    return scalar
