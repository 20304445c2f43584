"""``QuantizedLlama`` (4-bit CPU models on the kernels) against the dense model it wraps, and
how the kernels are built and chosen (compiler missing or failing, cache, fallbacks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from services.worker.kernels import Kernels, build
from services.worker.loaders import quantize_for_cpu
from services.worker.models.int_linears import Int4Linear, Int8Linear
from services.worker.models.kernel_llama import (
    QuantizedLlama,
    pack_q4_1,
    pack_q8_0,
    supports,
    unpack_q4_1,
)
from services.worker.models.llama import LlamaModel
from tests.model_runs import Slots, model_cache
from tests.worker_models import (
    ARCH_MODEL_TYPE,
    SCALAR_KERNEL_FLAGS as SCALAR_FLAGS,
    gen as _gen,
    random_model,
)

torch.set_num_threads(1)

QK = 32
ARCHS = sorted(ARCH_MODEL_TYPE)
VOCAB = 256


# ---- QuantizedLlama vs the dense model --------------------------------------------------------


def _snap_to_grid(model: LlamaModel) -> None:
    """Move the block linears onto the Q4_1 grid and the head onto the Q8_0 grid (in place), so
    the dense model computes exactly with the weights ``QuantizedLlama`` packs."""
    with torch.no_grad():
        for block in model.layers:
            for linear in (
                block.self_attn.qkv,
                block.self_attn.o_proj,
                block.mlp.gate_up,
                block.mlp.down_proj,
            ):
                w = linear.weight
                w.copy_(unpack_q4_1(*pack_q4_1(w)))
        head = model.lm_head.weight
        q, scale = pack_q8_0(head)
        head.copy_((q.float().view(head.shape[0], -1, QK) * scale[..., None]).view_as(head))


BLOCK = 8  # the tests' sequences span several blocks


def _decode_slots(model: nn.Module) -> Slots:
    """Four slots over a pool of 8-token blocks, every block zeroed up front (``torch.empty``
    otherwise: a block nobody allocates holds whatever the memory held), so what the forwards
    never wrote reads as zero."""
    cache = model_cache(model, blocks=16, block_size=BLOCK)
    cache.k.zero_()
    cache.v.zero_()
    return Slots(cache, 4)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_llama_tracks_the_dense_model(k: Kernels, arch: str) -> None:
    dense = random_model(arch, VOCAB, seed=11)
    _snap_to_grid(dense)
    assert supports(dense)
    wrapped = random_model(arch, VOCAB, seed=11)  # the same weights: QuantizedLlama owns this one
    _snap_to_grid(wrapped)
    quantized = QuantizedLlama(wrapped, k)
    g = _gen(300)
    slots, lengths = [2, 0, 3], [7, 3, 12]  # ragged rows in non-contiguous slots
    prompts = [torch.randint(0, VOCAB, (1, t), generator=g) for t in lengths]
    caches = [_decode_slots(dense), _decode_slots(quantized)]  # fp32; the kernels' halves
    last = []
    with torch.inference_mode():
        for slot, ids in zip(slots, prompts, strict=True):
            T = ids.shape[1]
            want = caches[0].forward(dense, ids, [slot], [0], n_logits=T)
            got = caches[1].forward(quantized, ids, [slot], [0], n_logits=T)
            # Prefill (T > 1) runs the same kernels (8-bit activations) around torch attention.
            assert ((got - want).abs().max() / want.abs().max()).item() < 0.02
            last.append(want[0, -1])
        tokens = torch.stack(last).argmax(-1, keepdim=True)  # (3, 1)
        starts = list(lengths)
        worst = 0.0
        for _ in range(5):  # the decode steps cross block boundaries (8 and 16 tokens)
            want = caches[0].forward(dense, tokens, slots, starts)
            got = caches[1].forward(quantized, tokens, slots, starts)
            assert got.shape == want.shape == (3, 1, VOCAB) and got.dtype == torch.float32
            rel = ((got - want).abs().max() / want.abs().max()).item()
            worst = max(worst, rel)
            tokens = want[:, 0].argmax(-1, keepdim=True)  # both models see the same tokens
            starts = [s + 1 for s in starts]
    # On-grid weights leave 8-bit activations as the only loss: measured below 1 %.
    assert worst < 0.02, f"decode logits differ by {worst:.2%} of the largest logit"
    # Each slot holds just the blocks its tokens need, and the decode steps wrote the same keys
    # and values (up to 8-bit activations).
    for c in caches:
        assert [len(c.tables[s]) for s in slots] == [-(-end // BLOCK) for end in starts]
        assert c.cache.pool.used == sum(len(t) for t in c.tables)
    for slot, end in zip(slots, starts, strict=True):
        (gk, gv), (wk, wv) = caches[1].kv(slot, end), caches[0].kv(slot, end)
        for got, want in ((gk, wk), (gv, wv)):
            assert ((got - want).abs().max() / want.abs().max()).item() < 0.03
    # Nothing else was written: neither the blocks no slot holds nor the positions past a
    # slot's length in its last block.
    for c in caches:
        written = torch.zeros(c.cache.num_blocks, BLOCK, dtype=torch.bool)  # (block, offset)
        for slot, end in zip(slots, starts, strict=True):
            for p in range(end):
                written[c.tables[slot][p // BLOCK], p % BLOCK] = True
        for kv in (c.cache.k, c.cache.v):  # (layers, KV, blocks, BS, hd)
            by_position = kv.permute(2, 3, 0, 1, 4)  # (blocks, BS, layers, KV, hd)
            assert by_position[written].any(-1).all()  # every written key and value vector
            assert not by_position[~written].any()


# ---- build and fallback -----------------------------------------------------------------------


def test_build_with_a_missing_compiler_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    out = tmp_path / "cache"
    with pytest.raises(RuntimeError):
        build(directory=out)
    assert not list(out.glob("*.so"))  # no half-built or empty library left behind


def test_build_with_a_failing_compiler_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", "false")
    out = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="failed"):
        build(directory=out)
    assert not list(out.glob("*.so"))


def test_build_is_cached(tmp_path: Path) -> None:
    first = build(flags=SCALAR_FLAGS, directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build(flags=SCALAR_FLAGS, directory=tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert build(flags=[*SCALAR_FLAGS, "-DX=1"], directory=tmp_path) != first  # flags are keyed


def test_quantize_for_cpu_without_kernels_falls_back_to_torch_int4() -> None:
    model = random_model("LlamaForCausalLM", VOCAB, seed=4)
    ready = quantize_for_cpu(model, None)
    assert ready is model
    assert isinstance(model.layers[0].mlp.gate_up, Int4Linear)
    assert isinstance(model.layers[1].self_attn.qkv, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear)


def test_quantize_for_cpu_picks_the_kernels_only_when_vectorized(k: Kernels) -> None:
    model = random_model("Qwen2ForCausalLM", VOCAB, seed=5)
    ready = quantize_for_cpu(model, k)
    if k.vectorized:
        assert isinstance(ready, QuantizedLlama) and ready.model is model
        assert model.layers[0].mlp.gate_up.weight.numel() == 0  # dense weights released
    else:  # the scalar loops are slower than torch's int4 kernels
        assert ready is model and isinstance(model.layers[0].mlp.gate_up, Int4Linear)


def test_quantize_for_cpu_falls_back_when_widths_do_not_split_into_blocks(k: Kernels) -> None:
    model = random_model("LlamaForCausalLM", VOCAB, seed=6, intermediate_size=80)
    assert not supports(model)
    ready = quantize_for_cpu(model, k)
    assert ready is model and isinstance(model.layers[0].self_attn.qkv, Int4Linear)
