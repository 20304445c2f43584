"""GGUF and Hugging Face loading: round trips, the GGUF tokenizer, one clear error per failure."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker.loaders import ModelLoadError, load_model
from services.worker.loaders.gguf import dequantize_fast, unpermute_qk
from services.worker.loaders.tokenizer import build_gguf_tokenizer
from services.worker.models.llama import LlamaModel
from tests.model_runs import prefill_logits
from tests.worker_models import (
    CORPUS,
    MARKERS,
    SPECIAL,
    hf_state_dict,
    permute_qk,
    random_model,
    tiny_tokenizer,
    write_gguf,
    write_hf_model,
)

torch.set_num_threads(1)

TEXTS = [
    *CORPUS,
    "<|im_start|>user\nhi<think>x</think><tool_call>{}</tool_call><|im_end|>",
    "  a\tb\r\n",
]
GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    return prefill_logits(model, ids)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (8, 2):
        permuted = permute_qk(w, heads)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_qk(torch.from_numpy(permuted), heads).numpy(), w)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_fast_dequantize_equals_gguf_reference(qtype: Q) -> None:
    a = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    packed = gguf.quants.quantize(a, qtype)
    fast = dequantize_fast(packed, qtype)
    assert fast is not None
    assert np.array_equal(fast.numpy(), gguf.quants.dequantize(packed, qtype).reshape(-1))
    assert dequantize_fast(packed, Q.Q6_K) is None


@pytest.mark.parametrize(
    ("qtype", "atol"), [(Q.F32, 0.0), (Q.F16, 2e-3), (Q.Q8_0, 2e-2), (Q.Q4_1, 0.15)]
)
@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
def test_gguf_round_trip_matches_hf_weights_and_logits(
    tmp_path: Path, arch: str, qtype: Q, atol: float
) -> None:
    tk = tiny_tokenizer()
    model = random_model(arch, tk.get_vocab_size(), seed=7)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, tk, GGUF_ARCH[arch], qtype)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    want, got = hf_state_dict(model), hf_state_dict(loaded.model)
    assert set(want) == set(got)
    for name in want:  # q/k rows are back in HF order, i.e. the permutation round-trips
        torch.testing.assert_close(got[name], want[name], atol=atol * 4 + 1e-6, rtol=0)
    ids = tk.encode(CORPUS[0]).ids
    diff = (_logits(loaded.model, ids) - _logits(model, ids)).abs().max().item()
    assert diff <= atol * 50 + 1e-5
    assert loaded.card.architecture == GGUF_ARCH[arch]
    assert loaded.card.eos_token_ids == [2] and loaded.card.eos_token == "<|im_end|>"
    assert loaded.card.chat_template.startswith("{%- if tools %}")
    assert loaded.card.reasoning is not None and loaded.card.reasoning.close_id == tk.token_to_id(
        "</think>"
    )


def test_gguf_tokenizer_reproduces_ids_and_specials(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    model = random_model("LlamaForCausalLM", tk.get_vocab_size())
    write_gguf(tmp_path / "t.gguf", model, tk)
    rebuilt = load_model(str(tmp_path / "t.gguf")).tokenizer
    for text in TEXTS:
        assert rebuilt.encode(text).ids == tk.encode(text).ids, text
        assert rebuilt.decode(rebuilt.encode(text).ids, skip_special_tokens=False) == text
    for token in SPECIAL + MARKERS:
        assert rebuilt.token_to_id(token) == tk.token_to_id(token)
    added = {t.content: t.special for t in rebuilt.get_added_tokens_decoder().values()}
    assert all(added[t] for t in SPECIAL) and not any(added[t] for t in MARKERS)


def test_smollm_pre_tokenizer_splits_digits() -> None:
    tk = tiny_tokenizer()
    vocab = tk.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tk.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    smol = build_gguf_tokenizer("gpt2", "smollm", tokens, [1] * len(tokens), merges)
    pieces = smol.encode("123 456").tokens
    assert all(len(p.strip("Ġ")) <= 1 for p in pieces), pieces


# -- errors: one ModelLoadError with a clear message per unloadable case ----------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def test_unknown_architecture_hf(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"unknown architecture.*GPTNeoX"):
        load_model(str(tmp_path / "m"))


def test_unknown_architecture_gguf(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    write_gguf(
        tmp_path / "m.gguf",
        random_model("LlamaForCausalLM", tk.get_vocab_size()),
        tk,
        arch="falcon",
    )
    with pytest.raises(ModelLoadError, match="unknown architecture 'falcon'"):
        load_model(str(tmp_path / "m.gguf"))


def test_unsupported_quant_type_is_named(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    model = random_model("LlamaForCausalLM", tk.get_vocab_size())
    raw = gguf.quants.quantize(np.zeros((64, 256), dtype=np.float32), Q.Q8_0)
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    iq = np.zeros((128, 64 // block * size), dtype=np.uint8)  # gate: [128, 64] in IQ4_NL
    assert raw.size > 0
    write_gguf(
        tmp_path / "m.gguf", model, tk, tensor_override={"blk.0.ffn_gate.weight": (iq, Q.IQ4_NL)}
    )
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate\.weight.*IQ4_NL"):
        load_model(str(tmp_path / "m.gguf"))


def test_truncated_gguf(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    path = tmp_path / "m.gguf"
    write_gguf(path, random_model("LlamaForCausalLM", tk.get_vocab_size()), tk)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(str(path))


def test_wrong_tensor_shape_is_named(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    model = random_model("LlamaForCausalLM", tk.get_vocab_size())
    bad = np.zeros((128, 32), dtype=np.float32)  # ffn_gate should be [128, 64]
    write_gguf(
        tmp_path / "m.gguf", model, tk, tensor_override={"blk.1.ffn_gate.weight": (bad, Q.F32)}
    )
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.gate_proj\.weight': \(128, 32\)"):
        load_model(str(tmp_path / "m.gguf"))


def test_non_finite_tensor_is_named(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    model = random_model("LlamaForCausalLM", tk.get_vocab_size())
    bad = np.full((64, 64), np.nan, dtype=np.float32)
    write_gguf(
        tmp_path / "m.gguf", model, tk, tensor_override={"blk.0.attn_output.weight": (bad, Q.F32)}
    )
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight holds NaN"):
        load_model(str(tmp_path / "m.gguf"))


def test_unknown_pre_tokenizer(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    write_gguf(
        tmp_path / "m.gguf",
        random_model("LlamaForCausalLM", tk.get_vocab_size()),
        tk,
        pre="mystery-pre",
    )
    with pytest.raises(ModelLoadError, match=r"unknown tokenizer\.ggml\.pre 'mystery-pre'"):
        load_model(str(tmp_path / "m.gguf"))


def test_corrupt_safetensors(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "m")
    (tmp_path / "m/model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match=r"corrupt weight file model\.safetensors"):
        load_model(str(tmp_path / "m"))


def test_missing_shard_and_tokenizer(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "m", shards=2)
    (tmp_path / "m/model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weight shard model-00002-of-00002"):
        load_model(str(tmp_path / "m"))
    write_hf_model(tmp_path / "n")
    (tmp_path / "n/tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing tokenizer\.json"):
        load_model(str(tmp_path / "n"))


def test_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"neither a \.gguf file nor a model directory"):
        load_model(str(tmp_path / "weights.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"missing config\.json"):
        load_model(str(tmp_path / "empty"))


def test_bad_device_and_dtype(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        load_model(str(tmp_path / "m"), device="cpu", dtype="float8")
    with pytest.raises(ModelLoadError, match="unknown device 'tpu'"):
        load_model(str(tmp_path / "m"), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            load_model(str(tmp_path / "m"), device="cuda")
