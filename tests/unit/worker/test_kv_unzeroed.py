"""A model on the CPU kernels reads only the cache positions it wrote, so its paged KV cache hands
out blocks without zero-filling them (``PagedKVCache(zeroed=False)``); torch's attention reads
whole blocks and keeps a zeroed cache."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from services.worker import kernels
from services.worker.kv_cache import PagedKVCache, SeqRows, build_batch
from services.worker.loaders.gguf import load_gguf
from services.worker.models.kernel_llama import QuantizedLlama
from tests.model_runs import model_cache, rows_for
from tests.worker_models import (
    gen,
    kernels_or_skip,
    random_model,
    tiny_q4_0_gguf,
    tiny_tokenizer,
    write_gguf,
)

CPU = torch.device("cpu")
BLOCK = 8


def _run(
    model: torch.nn.Module, cache: PagedKVCache, prompts: list[list[int]], tables: list[list[int]]
) -> torch.Tensor:
    """Prefill two ragged prompts, each through its block table, then one decode step of both."""
    out = []
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            batch = build_batch([SeqRows(i, tables[i], 0, len(ids), len(ids))], BLOCK, CPU)
            out.append(model(torch.tensor(ids), batch, cache))
        seqs = [SeqRows(i, tables[i], len(ids), 1) for i, ids in enumerate(prompts)]
        out.append(model(torch.tensor([5, 17]), build_batch(seqs, BLOCK, CPU), cache))
    return torch.cat(out)


def test_the_kernels_never_read_a_position_they_did_not_write(tmp_path: Path) -> None:
    k = kernels_or_skip()
    path = tmp_path / "m.gguf"
    tk = tiny_q4_0_gguf(path, seed=4)
    loaded, _, _, file = load_gguf(path, "m")
    model = QuantizedLlama(loaded, k, file)
    assert model.reads_only_written_kv
    prompts = [
        tk.encode("The capital of France is Paris. The quick brown fox jumps over the dog.").ids,
        tk.encode("Hello world!").ids,
    ]
    need = [-(-(len(ids) + 1) // BLOCK) for ids in prompts]  # the decode step's token too
    assert need[0] >= 3  # the first prompt spans several blocks
    # Clean: a zeroed pool, each sequence's blocks in allocation order.
    clean_cache = model_cache(model, blocks=16, block_size=BLOCK)
    in_order: list[list[int]] = [[], []]
    for i, ids in enumerate(prompts):
        rows_for(clean_cache, in_order[i], 0, len(ids) + 1)
    clean = _run(model, clean_cache, prompts, in_order)
    # Poisoned: an unzeroed pool (as the scheduler gives this model) where every position no
    # row wrote reads as NaN (the rest of each sequence's last block, the blocks nobody holds),
    # and the sequences' blocks scattered through the pool, out of order and interleaved.
    poisoned = PagedKVCache(
        layers=model.config.num_layers,
        num_blocks=16,
        block_size=BLOCK,
        kv_heads=model.config.num_kv_heads,
        head_dim=model.config.head_dim,
        dtype=model.kv_dtype,
        device=CPU,
        zeroed=False,
    )
    poisoned.k.fill_(float("nan"))
    poisoned.v.fill_(float("nan"))
    blocks = [poisoned.allocate() for _ in range(poisoned.num_blocks)]
    assert poisoned.k.isnan().all() and poisoned.v.isnan().all()  # allocation wrote nothing
    order = [blocks[int(j)] for j in torch.randperm(len(blocks), generator=gen(7))]
    scrambled = [order[0 : 2 * need[0] : 2], order[1 : 2 * need[1] : 2]]
    assert all(t != sorted(t) for t in scrambled if len(t) > 1)
    got = _run(model, poisoned, prompts, scrambled)
    assert torch.isfinite(got).all() and torch.equal(got, clean)


def test_a_fresh_block_is_zero_filled_once_and_only_in_a_zeroed_cache() -> None:
    def pool(zeroed: bool) -> PagedKVCache:
        return PagedKVCache(layers=2, num_blocks=3, block_size=BLOCK, kv_heads=1, head_dim=4,
                            dtype=torch.float32, device=CPU, zeroed=zeroed)  # fmt: skip

    written = torch.randn(2, 1, BLOCK, 4)  # (layers, kv heads, block size, head dim)
    for zeroed in (True, False):
        cache = pool(zeroed)
        cache.k.fill_(float("nan"))  # memory nobody wrote
        cache.v.fill_(float("nan"))
        first = cache.allocate()
        for kv in (cache.k, cache.v):
            if zeroed:
                assert not kv[:, :, first].any()
            else:
                assert kv[:, :, first].isnan().all()
            others = [b for b in range(3) if b != first]
            assert kv[:, :, others].isnan().all()  # the others: untouched
        cache.k[:, :, first] = written
        cache.v[:, :, first] = -written
        second = cache.allocate()  # another block leaves what was written
        assert second != first and bool(cache.k[:, :, second].isnan().all()) != zeroed
        cache.pool.release([first])
        assert cache.allocate() == first  # handed out again: kept as written, not re-zeroed
        assert torch.equal(cache.k[:, :, first], written)
        assert torch.equal(cache.v[:, :, first], -written)


def test_the_scheduler_zeroes_the_cache_only_for_torch_attention(tmp_path: Path) -> None:
    from services.worker.scheduler import Scheduler

    tk = tiny_tokenizer(380)
    dense = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=6)

    def cache_of(model: torch.nn.Module) -> PagedKVCache:
        return Scheduler(model, tk, eos_ids=[0], max_batch=2, device=CPU, dtype=torch.float32,
                         make_decoder=lambda *_: None, num_blocks=4, block_size=16).cache  # type: ignore[arg-type]  # fmt: skip

    assert cache_of(dense).zeroed
    k = kernels.load()
    if k is not None and k.vectorized:
        path = tmp_path / "m.gguf"
        write_gguf(path, dense, tk, qtype=gguf.GGMLQuantizationType.Q4_0)
        loaded, _, _, file = load_gguf(path, "m")
        assert not cache_of(QuantizedLlama(loaded, k, file)).zeroed
