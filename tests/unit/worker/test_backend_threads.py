"""Who gets the worker's threads: a model on the CPU kernels takes ``SLUICE_THREADS`` for its
forwards and leaves torch one thread from the load on (TorchBackend.load says why); a model torch
runs gets them all."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.worker import kernels
from services.worker.models.kernel_llama import QuantizedLlama
from services.worker.torch_backend import TorchBackend
from shared.config import Settings
from tests.worker_models import kernels_or_skip, tiny_q4_0_gguf, write_hf_model


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    k = kernels.load()
    before = k.compute_threads if k is not None else 0
    yield
    torch.set_num_threads(threads)
    if k is not None:
        k.compute_threads = before


def test_a_model_on_the_kernels_takes_the_threads_and_torch_keeps_one(tmp_path: Path) -> None:
    kernels_or_skip()
    path = tmp_path / "m.gguf"
    tiny_q4_0_gguf(path, seed=3)
    backend = TorchBackend.load(Settings(device="cpu", threads=3), str(path), None)
    model = backend.loaded.model
    assert isinstance(model, QuantizedLlama)
    assert torch.get_num_threads() == 1
    assert model.kernels.forward_threads(1) == 3 and model.kernels.forward_threads(64) == 3


def test_a_model_torch_runs_gets_the_threads(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "hf")
    backend = TorchBackend.load(Settings(device="cpu", dtype="float32", threads=2),
                                str(tmp_path / "hf"), None)  # fmt: skip
    assert not isinstance(backend.loaded.model, QuantizedLlama)
    assert torch.get_num_threads() == 2
