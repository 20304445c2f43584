"""The GPU's paged attention kernel, run on the CPU through Triton's interpreter: it equals the
row-by-row reference on ragged rows (block boundaries, shared tables, GQA groups, head sizes that
are not powers of two, every split count), and a model's forward through it equals torch's
gather-and-mask attention on decode-only and mixed batches."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

from services.worker import fused_ops, paged_attention as pa
from services.worker.kv_cache import build_batch
from tests.model_runs import model_cache, rows_for
from tests.worker_models import random_model

pytest.importorskip("triton")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled there


@pytest.fixture
def kernel() -> ModuleType:
    """The kernels: interpreted on CPU tensors where no GPU is present (``tests/conftest.py``)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET was set")
    return pa


def test_split_count_is_a_power_of_two_that_fills_the_chip() -> None:
    counts = [pa.split_count(rows, kv) for rows in (1, 3, 17, 64, 256) for kv in (1, 3, 8)]
    assert all(c & (c - 1) == 0 and 1 <= c <= 16 for c in counts)
    assert pa.split_count(1, 8) == 16
    assert pa.split_count(256, 8) == 1


@pytest.mark.parametrize(("kv", "group", "hd"), [(2, 3, 32), (1, 1, 16), (2, 4, 80)])
@pytest.mark.parametrize("splits", [1, 2, 16])
def test_kernel_equals_reference_on_ragged_rows(
    kernel: ModuleType, kv: int, group: int, hd: int, splits: int
) -> None:
    g = torch.Generator().manual_seed(kv * 100 + group * 10 + splits)
    blocks, bs = 40, 16
    k = torch.randn(kv, blocks, bs, hd, generator=g)
    v = torch.randn(kv, blocks, bs, hd, generator=g)
    tables = torch.randperm(blocks, generator=g)[:36].view(4, 9).int()
    seq = torch.tensor([0, 2, 1, 3, 0, 2])
    # one token, a block's last and next first, a long row, the table's last position
    pos = torch.tensor([0, 15, 16, 100, 143, 63])
    q = torch.randn(6, kv * group, hd, generator=g)
    want = pa.paged_attention_reference(q, k, v, tables, seq, pos, 0.125)
    on = [t.to(DEV) for t in (q, k, v, tables, seq, pos)]
    got = kernel.paged_attention(*on, 0.125, splits=splits)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)


def test_reference_is_attention_over_the_prefix() -> None:
    """The reference itself against plain softmax attention on contiguous keys."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 4, 16, 8, generator=g)
    v = torch.randn(1, 4, 16, 8, generator=g)
    tables = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    q = torch.randn(1, 2, 8, generator=g)
    out = pa.paged_attention_reference(q, k, v, tables, torch.tensor([0]), torch.tensor([40]), 0.5)
    keys = k[0, [2, 0, 3]].reshape(-1, 8)[:41]
    values = v[0, [2, 0, 3]].reshape(-1, 8)[:41]
    want = torch.softmax(q[0] @ keys.T * 0.5, dim=-1) @ values
    torch.testing.assert_close(out[0], want)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_model_forward_through_the_kernel_equals_torch_attention(
    kernel: ModuleType, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt, then a step mixing a prompt chunk after a cached prefix with decode rows, then
    a decode-only step: logits through the GPU's kernels (paged attention, fused norms, rotary
    and cache store, SwiGLU) equal torch's ops at every step."""
    model = random_model(arch, 97, seed=7).to(DEV)
    caches = [model_cache(model, blocks=32, device=DEV) for _ in range(2)]
    caches[0].paged_kernel, caches[1].paged_kernel = False, True
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (21, 9, 40)]
    outs: list[list[torch.Tensor]] = [[], []]
    with torch.inference_mode():
        for cache, out in zip(caches, outs, strict=True):
            monkeypatch.setattr(fused_ops, "FORCE", cache.paged_kernel)
            tables: list[list[int]] = [[], [], []]
            # step 1: the first two prompts whole
            spans = [rows_for(cache, tables[i], 0, len(prompts[i]), key=i) for i in (0, 1)]
            ids = prompts[0] + prompts[1]
            out.append(model(torch.tensor(ids, device=DEV), build_batch(spans, 16, DEV), cache))
            # step 2: one decode row each, and the third prompt's tail after its first 17 tokens
            # (its head computed alone first)
            head = rows_for(cache, tables[2], 0, 17, key=2)
            model(torch.tensor(prompts[2][:17], device=DEV), build_batch([head], 16, DEV), cache)
            spans = [
                rows_for(cache, tables[0], 21, 1, key=0),
                rows_for(cache, tables[2], 17, 23, key=2),
                rows_for(cache, tables[1], 9, 1, key=1),
            ]
            ids = [5, *prompts[2][17:], 6]
            out.append(model(torch.tensor(ids, device=DEV), build_batch(spans, 16, DEV), cache))
            # step 3: decode only
            spans = [
                rows_for(cache, tables[i], n, 1, key=i) for i, n in ((0, 22), (1, 10), (2, 40))
            ]
            batch = build_batch(spans, 16, DEV)
            assert batch.decode_only
            out.append(model(torch.tensor([7, 8, 9], device=DEV), batch, cache))
    for torch_attn, paged in zip(*outs, strict=True):
        torch.testing.assert_close(paged, torch_attn, atol=1e-4, rtol=1e-4)
