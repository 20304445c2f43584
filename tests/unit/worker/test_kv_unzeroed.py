"""A model on the CPU kernels reads only the cache positions it wrote, so its KV cache grows
without zero-filling (``KVCache(zeroed=False)``); torch's attention keeps a zeroed cache."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from services.worker import kernels
from services.worker.kv_cache import KVCache, build_batch
from services.worker.loaders.gguf import load_gguf
from services.worker.models.kernel_llama import QuantizedLlama
from tests.worker_models import (
    kernels_or_skip,
    model_cache,
    random_model,
    tiny_q4_0_gguf,
    tiny_tokenizer,
    write_gguf,
)

CPU = torch.device("cpu")


def _run(model: torch.nn.Module, cache: KVCache, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill two ragged prompts in slots 0 and 1, then one decode step of both."""
    out = []
    with torch.inference_mode():
        for slot, ids in enumerate(prompts):
            cache.reserve(len(ids))
            batch = build_batch([slot], [0], len(ids), CPU)
            out.append(model(torch.tensor([ids]), batch, cache, len(ids))[0])
        lengths = [len(ids) for ids in prompts]
        cache.reserve(max(lengths) + 1)
        batch = build_batch([0, 1], lengths, 1, CPU)
        out.append(model(torch.tensor([[5], [17]]), batch, cache)[:, 0])
    return torch.cat(out)


def test_the_kernels_never_read_a_position_they_did_not_write(tmp_path: Path) -> None:
    k = kernels_or_skip()
    path = tmp_path / "m.gguf"
    tk = tiny_q4_0_gguf(path, seed=4)
    loaded, _, _, file = load_gguf(path, "m")
    model = QuantizedLlama(loaded, k, file)
    assert model.reads_only_written_kv
    prompts = [tk.encode("The capital of France is Paris.").ids, tk.encode("Hello world!").ids]
    clean = _run(model, model_cache(model, slots=2), prompts)
    poisoned = model_cache(model, slots=2)
    poisoned.k.fill_(float("nan"))  # every position no row wrote reads as NaN
    poisoned.v.fill_(float("nan"))
    got = _run(model, poisoned, prompts)
    assert torch.isfinite(got).all() and torch.equal(got, clean)


def test_growth_without_zeros_keeps_what_was_written() -> None:
    cache = KVCache(layers=2, slots=3, kv_heads=1, head_dim=4, max_len=64, dtype=torch.float32,
                    device=CPU, initial=8, zeroed=False)  # fmt: skip
    written = torch.randn(2, 3, 1, 8, 4)
    cache.k.copy_(written)
    cache.v.copy_(-written)
    cache.reserve(20)
    assert cache.capacity == 32
    assert torch.equal(cache.k[:, :, :, :8], written) and torch.equal(
        cache.v[:, :, :, :8], -written
    )


def test_the_scheduler_zeroes_the_cache_only_for_torch_attention(tmp_path: Path) -> None:
    from services.worker.scheduler import Scheduler

    tk = tiny_tokenizer(380)
    dense = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=6)

    def cache_of(model: torch.nn.Module) -> KVCache:
        return Scheduler(model, tk, eos_ids=[0], max_batch=2, device=CPU, dtype=torch.float32,
                         make_decoder=lambda *_: None).cache  # type: ignore[arg-type,return-value]  # fmt: skip

    assert cache_of(dense).zeroed
    k = kernels.load()
    if k is not None and k.vectorized:
        path = tmp_path / "m.gguf"
        write_gguf(path, dense, tk, qtype=gguf.GGMLQuantizationType.Q4_0)
        loaded, _, _, file = load_gguf(path, "m")
        assert not cache_of(QuantizedLlama(loaded, k, file)).zeroed
