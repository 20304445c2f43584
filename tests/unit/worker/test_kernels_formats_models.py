"""Tiny models written in each GGUF weight format, loaded onto the CPU kernels: their logits
track the dense model's, types without a kernel still load (and say which path each took), and
the lazy load never holds dense copies of what the kernels read."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker import kernels
from services.worker.kernels import (
    Kernels,
)
from services.worker.loaders import ModelLoadError, load_model
from services.worker.loaders.gguf import load_gguf
from services.worker.models.blocks import (
    Q5_M,
)
from services.worker.models.kernel_llama import QuantizedLlama
from tests.model_runs import Slots, model_cache
from tests.unit.worker.test_kernels_formats import _random_blocks
from tests.worker_models import (
    ARCH_MODEL_TYPE,
    hf_state_dict,
    random_model,
    tiny_tokenizer,
    write_gguf,
)

torch.set_num_threads(1)


def _logits(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits of two ragged prompts in two slots, then one decode step of both rows,
    on a cache of halves (the kernels' keys and values; the dense model reads them widened)."""
    slots = Slots(model_cache(model, dtype=torch.float16), 2)
    lengths = [len(ids) for ids in prompts]
    with torch.inference_mode():
        rows = [
            slots.forward(model, torch.tensor([ids]), [slot], [0], len(ids))[0]
            for slot, ids in enumerate(prompts)
        ]
        decode = slots.forward(model, torch.tensor([[5], [17]]), [0, 1], lengths)[:, 0]
    return torch.cat(rows), decode


# the kernel format each type written by gguf-py is packed into (every linear here has a
# multiple of eight rows: the 5-bit types take Q5_M)
KERNEL_FORMAT = {Q.Q4_0: Q.Q4_0, Q.Q4_1: Q.Q4_1, Q.Q8_0: Q.Q8_0, Q.Q5_0: Q5_M, Q.Q5_1: Q5_M}


@pytest.mark.parametrize("qtype", list(KERNEL_FORMAT))
@pytest.mark.parametrize("arch", sorted(ARCH_MODEL_TYPE))
def test_tiny_model_in_each_format_tracks_the_dense_model(
    k: Kernels, tmp_path: Path, arch: str, qtype: Q
) -> None:
    tk = tiny_tokenizer(380)  # 384 tokens: the head splits into groups of eight rows too
    model = random_model(arch, tk.get_vocab_size(), seed=21)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tk, ARCH_MODEL_TYPE[arch], qtype)
    dense = load_model(str(path), device="cpu", dtype="float32").model
    loaded, _, _, file = load_gguf(path, "m")
    quantized = QuantizedLlama(loaded, k, file)
    linears = [quantized.head] + [
        lin for b in quantized.blocks for lin in (b.qkv, b.o_proj, b.gate_up, b.down)
    ]
    # every one packed from the file's blocks
    assert {lin.type for lin in linears} == {int(KERNEL_FORMAT[qtype])}
    prompts = [tk.encode("The capital of France is Paris.").ids, tk.encode("Hello world!").ids]
    for got, want in zip(_logits(quantized, prompts), _logits(dense, prompts), strict=True):
        assert got.shape == want.shape
        # The tolerance of the Q4_1 tests: 8-bit activations are the only loss.
        assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_types_without_a_kernel_still_load_and_the_paths_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("no vectorized CPU kernels here")
    tk = tiny_tokenizer(380)
    model = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=22)
    weights = hf_state_dict(model)
    v = weights["model.layers.0.self_attn.v_proj.weight"].numpy()
    down = weights["model.layers.1.mlp.down_proj.weight"].numpy()
    override = {"blk.0.attn_v.weight": (gguf.quants.quantize(v, Q.Q5_0), Q.Q5_0)}
    override["blk.1.ffn_down.weight"] = (down.astype(np.float16), Q.F16)
    path = tmp_path / "mixed.gguf"
    write_gguf(path, model, tk, qtype=Q.Q4_0, tensor_override=override)
    with caplog.at_level(logging.INFO):
        auto = load_model(str(path), device="cpu")
    assert isinstance(auto.model, QuantizedLlama)
    # No dense fp32 copy of what the kernels read from blocks: meta placeholders, embeddings
    # looked up from the file's Q4_0 rows; the F16 down projection loaded dense, then freed.
    layers = auto.model.model.layers
    assert layers[0].self_attn.qkv.weight.is_meta and layers[1].mlp.gate_up.weight.is_meta
    assert auto.model.embeddings is not None and auto.model.model.embed_tokens.weight.is_meta
    assert (
        layers[1].mlp.down_proj.weight.numel() == 0 and not layers[1].mlp.down_proj.weight.is_meta
    )
    blocks = auto.model.blocks
    assert blocks[0].qkv.fmt == "q5_m"  # Q4_0 q and k with a Q5_0 v: all exact as 5-bit values
    assert blocks[1].qkv.fmt == "q4_0" and blocks[1].down.fmt == "q8_0"
    logged = [r.getMessage() for r in caplog.records if "weights by type" in r.getMessage()]
    assert len(logged) == 1
    assert "Q4_0 x" in logged[0] and "Q4_0 kernel on the file's blocks" in logged[0]
    assert "Q5_0 x1: Q5_M kernel on the file's blocks" in logged[0]
    assert "F16 x1: dequantized, re-quantized as Q8_0" in logged[0]


def test_eight_bit_gguf_runs_on_the_kernels_by_default(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    model = random_model("Qwen2ForCausalLM", tk.get_vocab_size(), seed=23)
    write_gguf(tmp_path / "q8.gguf", model, tk, "qwen2", Q.Q8_0)
    auto = load_model(str(tmp_path / "q8.gguf"), device="cpu")
    off = load_model(str(tmp_path / "q8.gguf"), device="cpu", cpu_kernels=False)
    k = kernels.load()
    if k is not None and k.vectorized:
        assert isinstance(auto.model, QuantizedLlama)
        assert auto.model.blocks[0].gate_up.fmt == "q8_0"
    # Without the kernels an 8-bit file stays dense: torch's int4 kernels would lose precision.
    assert isinstance(off.model.layers[0].mlp.gate_up, torch.nn.Linear)


# 256-wide layers: K-quant super-blocks span 256 inputs.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.mark.parametrize("arch", sorted(ARCH_MODEL_TYPE))
def test_tiny_q4_k_model_tracks_the_dense_model(k: Kernels, tmp_path: Path, arch: str) -> None:
    tk = tiny_tokenizer(380)
    model = random_model(arch, tk.get_vocab_size(), seed=24, **WIDE)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tk, ARCH_MODEL_TYPE[arch], Q.Q4_K)
    dense = load_model(str(path), device="cpu", dtype="float32").model
    loaded, _, _, file = load_gguf(path, "m")
    quantized = QuantizedLlama(loaded, k, file)
    assert {b.gate_up.fmt for b in quantized.blocks} == {"q4_1"} and quantized.head.fmt == "q4_1"
    prompts = [tk.encode("The capital of France is Paris.").ids, tk.encode("Hello world!").ids]
    for got, want in zip(_logits(quantized, prompts), _logits(dense, prompts), strict=True):
        assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_q4_k_m_mix_runs_on_the_kernels(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A Q4_K_M file: Q4_K, with Q6_K attn_v and ffn_down, and one Q5_K (random blocks: the
    comparison is with the same file loaded dense)."""
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("no vectorized CPU kernels here")
    tk = tiny_tokenizer(380)
    model = random_model("Qwen2ForCausalLM", tk.get_vocab_size(), seed=25, **WIDE)
    override = {}
    shapes = {"blk.0.attn_v.weight": (128, 256), "blk.1.ffn_down.weight": (256, 512)}
    for name, (rows, cols) in shapes.items():
        override[name] = (_random_blocks(Q.Q6_K, rows, cols, seed=rows).data.numpy(), Q.Q6_K)
    # and one Q5_K (a Q5_K_M file's blocks)
    override["blk.0.ffn_down.weight"] = (_random_blocks(Q.Q5_K, 256, 512, 5).data.numpy(), Q.Q5_K)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tk, "qwen2", Q.Q4_K, tensor_override=override)
    dense = load_model(str(path), device="cpu", dtype="float32").model
    with caplog.at_level(logging.INFO):
        auto = load_model(str(path), device="cpu").model
    assert isinstance(auto, QuantizedLlama)
    # Q4_K q and k fused with a Q6_K v: one format for the linear, re-quantized as Q8_0
    assert auto.blocks[0].qkv.fmt == "q8_0"
    assert auto.blocks[1].down.fmt == "q8_16" and auto.blocks[0].down.fmt == "q5_m"
    assert auto.blocks[1].qkv.fmt == "q4_1" and auto.blocks[0].gate_up.fmt == "q4_1"
    logged = next(r.getMessage() for r in caplog.records if "weights by type" in r.getMessage())
    assert "Q4_K x" in logged and "Q4_1 kernel on the file's blocks" in logged
    assert "Q6_K x1: Q8_16 kernel on the file's blocks" in logged
    assert "Q6_K x1: dequantized, re-quantized as Q8_0" in logged
    assert "Q5_K x1: Q5_M kernel on the file's blocks" in logged
    prompts = [tk.encode("The capital of France is Paris.").ids, tk.encode("Hello world!").ids]
    for got, want in zip(_logits(auto, prompts), _logits(dense, prompts), strict=True):
        # Random Q6_K and Q5_K blocks make values up to ~250, where one 8-bit activation that
        # rounds the other way moves a logit most: the worst logit is 1.4-2.3 % of the largest
        # as caches and roundings vary (the mean 0.35 %), so this test allows 3 %.
        assert (got - want).abs().max().item() < 0.03 * want.abs().max().item()


def test_lazy_load_still_rejects_non_finite_blocks(tmp_path: Path) -> None:
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("no vectorized CPU kernels here")
    tk = tiny_tokenizer(380)
    model = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=27)
    bad = gguf.quants.quantize(
        hf_state_dict(model)["model.layers.1.mlp.up_proj.weight"].numpy(), Q.Q8_0
    )
    bad[3, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # a block's f16 scale
    path = tmp_path / "nan.gguf"
    write_gguf(
        path, model, tk, qtype=Q.Q8_0, tensor_override={"blk.1.ffn_up.weight": (bad, Q.Q8_0)}
    )
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight holds NaN or infinite"):
        load_model(str(path), device="cpu")
