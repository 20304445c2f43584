"""Weight-only int4 linears (CPU): exact on a 4-bit grid, and a 4-bit GGUF picks them by default."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from services.worker import kernels
from services.worker.loaders import load_model
from services.worker.models.int_linears import Int4Linear, Int8Linear, quantize_linears
from services.worker.models.kernel_llama import QuantizedLlama
from services.worker.models.llama import LlamaModel
from tests.model_runs import Slots, model_cache
from tests.worker_models import random_model, tiny_tokenizer, write_gguf

torch.set_num_threads(1)


def test_int4_linear_is_exact_on_a_four_bit_grid() -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 48, 64
    # Q4_1-style weights: per 32 inputs w = d * q + m with q spanning 0..15.
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0.0, 15.0
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.1 + 0.01
    m = torch.randn(n, k // 32, 1, generator=gen) * 0.1
    dense = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        dense.weight.copy_((d * q + m).view(n, k))
    x = torch.randn(3, 5, k, generator=gen)
    got = Int4Linear(dense)(x)
    # The kernel's only rounding is bf16 activations (and bf16 scales); compare at that precision.
    want = nn.functional.linear(x.bfloat16().float(), dense.weight, dense.bias)
    assert got.shape == (3, 5, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_quantize_linears_replaces_block_projections_and_head() -> None:
    model = random_model("Qwen2ForCausalLM", tiny_tokenizer().get_vocab_size())
    embedding = model.embed_tokens.weight.clone()
    replaced = quantize_linears(model)
    assert replaced == 2 * 4 + 1  # qkv, o_proj, gate_up, down_proj per block, and the lm_head
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.layers[0].self_attn.qkv, Int4Linear)
    assert torch.equal(model.embed_tokens.weight, embedding)  # embedding lookups stay exact


def test_int8_head_is_close_to_dense() -> None:
    gen = torch.Generator().manual_seed(1)
    dense = nn.Linear(64, 300, bias=False)
    x = torch.randn(2, 3, 64, generator=gen)
    got = Int8Linear(dense)(x)
    want = dense(x)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_four_bit_gguf_decodes_from_four_bits_on_cpu_by_default(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    model = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=9)
    write_gguf(tmp_path / "q4.gguf", model, tk, qtype=Q.Q4_1)
    auto = load_model(str(tmp_path / "q4.gguf"), device="cpu")
    dense = load_model(str(tmp_path / "q4.gguf"), device="cpu", dtype="float32")
    k = kernels.load()
    if k is not None and k.vectorized:  # sluice's kernels decode; the dense model prefills
        assert isinstance(auto.model, QuantizedLlama)
        assert not isinstance(auto.model.model.layers[0].mlp.gate_up, Int4Linear)
    else:  # no compiler (or no AVX2): torch's int4 kernels
        assert isinstance(auto.model.layers[0].mlp.gate_up, Int4Linear)
    assert isinstance(dense.model.layers[0].mlp.gate_up, nn.Linear)
    prompts = [tk.encode("The capital of France is Paris.").ids, tk.encode("Hello world!").ids]
    prefill, decode = [], []
    for lm in (auto, dense):
        slots = Slots(model_cache(lm.model), 2)
        lengths = [len(ids) for ids in prompts]
        with torch.inference_mode():
            # Each prompt in its own slot, then one decode step (one token each) of both, ragged.
            rows = [
                slots.forward(lm.model, torch.tensor([ids]), [slot], [0], len(ids))[0]
                for slot, ids in enumerate(prompts)
            ]
            prefill.append(torch.cat(rows))
            decode.append(slots.forward(lm.model, torch.tensor([[5], [17]]), [0, 1], lengths)[:, 0])
    for got, want in (prefill, decode):
        assert got.shape == want.shape
        # Measured: prefill exact (kernels) or 0.4 % (int4), decode 0.4 % of the largest logit.
        assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_cpu_kernels_off_uses_torch_int4(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    model = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=9)
    write_gguf(tmp_path / "q4.gguf", model, tk, qtype=Q.Q4_1)
    off = load_model(str(tmp_path / "q4.gguf"), device="cpu", cpu_kernels=False)
    assert isinstance(off.model, LlamaModel)
    assert isinstance(off.model.layers[0].mlp.gate_up, Int4Linear)
