"""Each architecture's forward: prefill vs KV-cache decode, ragged batches, HF directory loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.loaders import load_model
from services.worker.models.llama import LlamaConfig, LlamaModel, rope_inv_freq
from tests.model_runs import Slots, model_cache, prefill_logits
from tests.worker_models import ARCH_MODEL_TYPE, random_model, tiny_tokenizer, write_hf_model

torch.set_num_threads(1)

ARCHS = sorted(ARCH_MODEL_TYPE)
VOCAB = tiny_tokenizer().get_vocab_size()


def _slots(model: LlamaModel, slots: int = 4) -> Slots:
    """Slots over a paged cache of 8-token blocks: the tests' sequences span several blocks."""
    return Slots(model_cache(model, blocks=32, block_size=8), slots)


def _prefill_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position from one full-sequence forward."""
    return prefill_logits(model, ids, cache=model_cache(model, blocks=8, block_size=8))


def _stepwise_logits(model: LlamaModel, ids: list[int], slot: int = 1) -> torch.Tensor:
    """Logits from feeding ``ids`` one token at a time through the KV cache."""
    slots = _slots(model)
    rows = []
    for pos, token in enumerate(ids):  # a new block every 8 tokens
        rows.append(slots.forward(model, torch.tensor([[token]]), [slot], [pos])[0, -1])
    assert len(slots.tables[slot]) == 3
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_token_by_token_decode(arch: str) -> None:
    model = random_model(arch, VOCAB, seed=1)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        full = _prefill_logits(model, ids)
        step = _stepwise_logits(model, ids)
    assert full.shape == (20, VOCAB)
    torch.testing.assert_close(full, step, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_full_prefill(arch: str) -> None:
    model = random_model(arch, VOCAB, seed=2)
    ids = list(range(5, 30))
    slots = _slots(model)
    with torch.inference_mode():
        full = _prefill_logits(model, ids)[-1]
        slots.forward(model, torch.tensor([ids[:10]]), [2], [0])  # ends inside its second block
        last = slots.forward(model, torch.tensor([ids[10:]]), [2], [10])
    torch.testing.assert_close(last[0, -1], full, atol=1e-4, rtol=1e-4)


def _greedy(
    model: LlamaModel, prompts: list[list[int]], steps: int, slots: list[int]
) -> list[list[int]]:
    """Greedy decode of several prompts together: per-slot prefill, then ragged batched steps
    (the slots' blocks interleave in the pool as the sequences grow)."""
    cache = _slots(model, slots=max(slots) + 1)
    out: list[list[int]] = []
    lengths = []
    for prompt, slot in zip(prompts, slots, strict=True):
        logits = cache.forward(model, torch.tensor([prompt]), [slot], [0])
        out.append([int(logits[0, -1].argmax())])
        lengths.append(len(prompt))
    for _ in range(steps - 1):
        logits = cache.forward(model, torch.tensor([[o[-1]] for o in out]), slots, lengths)
        for i, row in enumerate(logits[:, -1]):
            out[i].append(int(row.argmax()))
            lengths[i] += 1
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batched_decode_equals_single_sequence(arch: str) -> None:
    model = random_model(arch, VOCAB, seed=4)
    prompts = [list(range(3, 3 + n)) for n in (4, 11, 7)]
    with torch.inference_mode():
        together = _greedy(model, prompts, steps=12, slots=[0, 1, 2])
        gathered = _greedy(model, prompts, steps=12, slots=[3, 0, 2])  # non-contiguous slots
        alone = [_greedy(model, [p], steps=12, slots=[0])[0] for p in prompts]
    assert together == alone
    assert gathered == alone


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_directory_loads_same_logits(tmp_path: Path, arch: str, shards: int) -> None:
    original = write_hf_model(tmp_path / "m", arch, shards=shards, seed=5)
    loaded = load_model(str(tmp_path / "m"), device="cpu", dtype="float32")
    ids = list(range(10, 30))
    with torch.inference_mode():
        torch.testing.assert_close(
            _prefill_logits(loaded.model, ids), _prefill_logits(original, ids)
        )
    assert loaded.card.architecture == arch
    assert loaded.card.eos_token_ids == [2]
    assert loaded.card.default_temperature == 0.7
    assert loaded.card.reasoning is not None and loaded.card.reasoning.open == "<think>"
    assert loaded.card.tools is not None and loaded.card.tools.open == "<tool_call>"


def test_qwen2_has_qkv_bias_and_qwen3_has_qk_norm() -> None:
    qwen2 = random_model("Qwen2ForCausalLM", VOCAB)
    qwen3 = random_model("Qwen3ForCausalLM", VOCAB)
    names2 = dict(qwen2.named_parameters())
    names3 = dict(qwen3.named_parameters())
    assert (
        "layers.0.self_attn.qkv.bias" in names2 and "layers.0.self_attn.o_proj.bias" not in names2
    )
    assert "layers.0.self_attn.q_norm.weight" in names3
    assert "layers.0.self_attn.qkv.bias" not in names3


def test_mistral_sliding_window_caps_context() -> None:
    model = random_model("MistralForCausalLM", VOCAB, sliding_window=128)
    assert model.config.context_length == 128


def test_llama3_rope_scaling_changes_only_low_frequencies() -> None:
    base = LlamaConfig(head_dim=128, rope_theta=500000.0)
    scaled = LlamaConfig(
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    a, b = rope_inv_freq(base), rope_inv_freq(scaled)
    assert torch.equal(a[:10], b[:10])  # high frequencies untouched
    torch.testing.assert_close(b[-1], a[-1] / 8.0)  # lowest frequency divided by the factor
