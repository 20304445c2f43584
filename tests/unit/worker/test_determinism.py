"""Greedy output does not depend on prefix-cache hits, prefill chunking, batch composition or a
failover's re-prefill, on the CPU kernels (``QuantizedLlama``): tiny random models of the Llama
and Qwen3 (per-head q/k norm) layouts through the real backend. ``tests/determinism.py`` holds
the conditions; the default model runs them in ``tests/integration/test_determinism_default.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker import kernels
from services.worker.loaders import load_model
from services.worker.models.kernel_llama import QuantizedLlama
from services.worker.torch_backend import TorchBackend
from tests.determinism import check_invariance
from tests.worker_models import gen, write_hf_model

torch.set_num_threads(2)  # threads split the work differently from one: the bits must not move

VOCAB = 384  # tiny_tokenizer's


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
async def test_greedy_output_is_invariant_on_the_kernels(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("the CPU kernels run only vectorized builds in the engine")
    write_hf_model(tmp_path / "tiny", arch, seed=5)
    loaded = load_model(str(tmp_path / "tiny"), dtype="int4")
    assert isinstance(loaded.model, QuantizedLlama)
    b = TorchBackend(loaded, max_batch=16)
    ids = torch.randint(3, VOCAB, (60,), generator=gen(7)).tolist()
    await b.start()
    try:
        await check_invariance(b, ids, VOCAB, 12, monkeypatch)
    finally:
        await b.stop()
