"""Tiny models for worker tests: random HF-layout weights, a GGUF writer, kernel builds.

* ``tiny_tokenizer()``: a real byte-level BPE ``tokenizers.Tokenizer`` trained in milliseconds on a
  small corpus, whose added tokens include the ChatML, reasoning and tool markers.
* ``write_hf_model(dir, arch)``: a 2-layer random model of one architecture saved as a Hugging Face
  directory (config.json, safetensors, tokenizer files, generation_config.json).
* ``write_gguf(path, ...)``: the same weights as GGUF via ``gguf.GGUFWriter`` (F32/F16/Q8_0/...),
  with llama.cpp's q/k permutation for the ``llama`` architecture and tokenizer metadata.

Running one outside the engine (a paged cache shaped for it, fixed slots, a whole-prompt
forward) is ``tests/model_runs.py``; the forced-sequence model double is
``tests/forced_model.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from services.worker import kernels
from services.worker.kernels import Kernels
from services.worker.models import MODELS
from services.worker.models.llama import LlamaModel

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Hello world! 123 456 7890. What is the weather in Paris today?",
    'get_weather {"city": "Paris", "unit": "celsius"} arguments name tool call',
    "user assistant system reasoning: let me think about this step by step.",
    "héllo wörld, naïve café, 東京, Ωmega, emoji 🙂 done.",
]

ARCH_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}


def tiny_tokenizer(vocab_size: int = 384) -> Tokenizer:
    """Train a small byte-level BPE tokenizer with the ChatML/reasoning/tool added tokens."""
    tk = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 4, trainer=trainer)
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    return tk


def tiny_hf_config(arch: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """A 2-layer, 64-wide config.json dict for ``arch`` (GQA 4 q-heads / 2 kv-heads)."""
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": ARCH_MODEL_TYPE[arch],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": arch == "LlamaForCausalLM",
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    cfg.update(overrides)
    return cfg


def random_model(arch: str, vocab_size: int, seed: int = 0, **overrides: Any) -> LlamaModel:
    """Build a tiny random-weight model of ``arch`` (norm weights perturbed so they matter)."""
    torch.manual_seed(seed)
    cls = MODELS[arch]
    model = cls(cls.config_from_hf(tiny_hf_config(arch, vocab_size, **overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name == "embed_tokens.weight":
                p.copy_(0.5 * torch.randn_like(p))
    return model.eval()


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Unfuse the model's parameters into Hugging Face tensor names."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone().contiguous()
        if ".qkv." in name:
            q, k, v = t.split(
                [
                    cfg.num_heads * cfg.head_dim,
                    cfg.num_kv_heads * cfg.head_dim,
                    cfg.num_kv_heads * cfg.head_dim,
                ]
            )
            for proj, part in zip("qkv", (q, k, v), strict=True):
                out["model." + name.replace("qkv", f"{proj}_proj")] = part.contiguous()
        elif ".gate_up." in name:
            gate, up = t.chunk(2)
            out["model." + name.replace("gate_up", "gate_proj")] = gate.contiguous()
            out["model." + name.replace("gate_up", "up_proj")] = up.contiguous()
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[name] = t
        else:
            out["model." + name] = t
    return out


def write_hf_model(
    directory: Path,
    arch: str = "LlamaForCausalLM",
    *,
    shards: int = 1,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    **overrides: Any,
) -> LlamaModel:
    """Save a tiny random model as a Hugging Face directory; return the in-memory model."""
    directory.mkdir(parents=True, exist_ok=True)
    tk = tokenizer or tiny_tokenizer()
    model = random_model(arch, tk.get_vocab_size(), seed, **overrides)
    state = hf_state_dict(model)
    names = sorted(state)
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"))
    else:
        weight_map: dict[str, str] = {}
        for i in range(shards):
            part = names[i::shards]
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: state[n] for n in part}, str(directory / file))
            weight_map.update(dict.fromkeys(part, file))
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    cfg = tiny_hf_config(arch, tk.get_vocab_size(), **overrides)
    (directory / "config.json").write_text(json.dumps(cfg))
    tk.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
            }
        )
    )
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2], "temperature": 0.7, "top_p": 0.9, "do_sample": True})
    )
    return model


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (HF rotate_half order -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    """Hugging Face tensor name -> GGUF tensor name."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.<kind>
    return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(
    path: Path,
    model: LlamaModel,
    tokenizer: Tokenizer,
    arch: str = "llama",
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    pre: str = "default",
    tensor_override: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> None:
    """Write ``model`` + ``tokenizer`` as a GGUF file (2-D weights in ``qtype``, norms in F32)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    added = tokenizer.get_added_tokens_decoder()
    types = [(3 if added[i].special else 4) if i in added else 1 for i in range(len(tokens))]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in hf_state_dict(model).items():
        a = t.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute_qk(a, cfg.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute_qk(a, cfg.num_kv_heads)
        target = gguf_name(name)
        if tensor_override and target in tensor_override:
            data, raw = tensor_override[target]
            w.add_tensor(target, data, raw_dtype=raw)
            continue
        kind = qtype if a.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(target, a)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(target, a.astype(np.float16))
        elif kind == gguf.GGMLQuantizationType.Q4_K:  # gguf-py cannot write K-quants
            w.add_tensor(target, quantize_q4_k(a), raw_dtype=kind)
        else:
            w.add_tensor(target, gguf.quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """(N, K) fp32, K % 256 == 0 -> GGUF Q4_K blocks (N, K / 256 * 144) uint8: per 32 values
    w = (d sc) q - (dmin m), sc and m 6-bit, q 4-bit. A plain min/max quantizer (llama.cpp's
    searches for better scales); the layout is ggml's block_q4_K, checked against gguf-py's
    dequantization in the tests."""
    n, k = a.shape
    x = a.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0.0), x.max(-1)
    scale, mins = (hi - lo) / 15.0, -lo  # per sub-block, both >= 0
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)

    def six_bits(v: np.ndarray, by: np.ndarray) -> np.ndarray:
        safe = np.where(by > 0, by.astype(np.float32), 1.0)[..., None]
        return np.clip(np.rint(v / safe), 0, 63).astype(np.uint8)

    sc, m = six_bits(scale, d), six_bits(mins, dmin)
    step = d.astype(np.float32)[..., None] * sc
    low = dmin.astype(np.float32)[..., None] * m
    safe = np.where(step > 0, step, 1.0)[..., None]
    q = np.clip(np.rint((x + low[..., None]) / safe), 0, 15).astype(np.uint8)
    scales = np.zeros((n, k // 256, 12), dtype=np.uint8)
    scales[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // 256, 128)
    halves = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)]
    return np.concatenate([*halves, scales, qs], -1).reshape(n, -1)


def gen(seed: int) -> torch.Generator:
    """A seeded CPU generator."""
    return torch.Generator().manual_seed(seed)


# The kernels' portable build: no -march=native, so the scalar loops (tests run both builds).
SCALAR_KERNEL_FLAGS = ["-O2", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# The AVX2 + FMA variant without AVX-512 (tests run it where the native build picks AVX-512).
AVX2_KERNEL_FLAGS = [*SCALAR_KERNEL_FLAGS, "-mavx2", "-mfma", "-mf16c"]


def kernels_or_skip() -> Kernels:
    """The native CPU kernels, or skip the test where no vectorized build loads."""
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("no vectorized CPU kernels here")
    return k


def tiny_q4_0_gguf(path: Path, seed: int) -> Tokenizer:
    """Write a tiny random Llama as a Q4_0 GGUF at ``path`` (it runs on the CPU kernels); its
    tokenizer."""
    tk = tiny_tokenizer(380)  # 384 tokens: the head splits into groups of eight rows
    model = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=seed)
    write_gguf(path, model, tk, qtype=gguf.GGMLQuantizationType.Q4_0)
    return tk
