"""Load a GGUF file: dequantize tensors, undo llama.cpp's Q/K permutation, rebuild the tokenizer.

Owns the GGUF -> Hugging Face name mapping and the metadata -> config mapping. Quantized blocks
are dequantized once at load (numpy, ``gguf.quants``) into dense weights; the Q4_0 / Q4_1 / Q8_0
blocks are also kept as they are (``FileWeights``) for the CPU kernels, which pack them exactly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType, GGUFReader
from gguf.quants import dequantize
from tokenizers import Tokenizer

from services.worker.loaders import ModelLoadError, build_card
from services.worker.loaders.tokenizer import TokenizerError, build_gguf_tokenizer
from services.worker.models import MODELS
from services.worker.models.blocks import (
    BLOCK_BYTES,
    KERNEL_TYPES,
    FileWeights,
    QuantBlocks,
    finite,
)
from services.worker.models.kernel_llama import fits
from services.worker.models.llama import LlamaModel, WeightError
from shared.model_card import ModelCard

__all__ = [
    "SUPPORTED_TYPES",
    "dequantize_fast",
    "is_four_bit",
    "is_quantized",
    "load_gguf",
    "read_metadata",
    "unpermute_qk",
]

SUPPORTED_TYPES = frozenset(
    {
        QType.F32,
        QType.F16,
        QType.BF16,
        QType.Q4_0,
        QType.Q4_1,
        QType.Q5_0,
        QType.Q5_1,
        QType.Q8_0,
        QType.Q4_K,
        QType.Q5_K,
        QType.Q6_K,
    }
)
# llama.cpp permutes q/k rows for these architectures only (convert_hf_to_gguf LlamaModel).
_PERMUTED_ARCHS = frozenset({"llama", "mistral"})

_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's interleaved-RoPE row order of a q or k projection (per head)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _blocks(data: np.ndarray, block_bytes: int) -> torch.Tensor:
    # np.array copies off the read-only mmap (torch warns on non-writable arrays).
    return torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(-1, block_bytes)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()  # (N, 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Q4 layout: low nibbles are elements 0..15 of a block, high nibbles 16..31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1).float()  # (N, 32)


def dequantize_fast(data: np.ndarray, qtype: QType) -> torch.Tensor | None:
    """Vectorised torch dequantisation of Q4_0/Q4_1/Q8_0 (numpy gguf-py is ~10x slower).

    Returns:
        A flat fp32 tensor, or None for types left to ``gguf.quants.dequantize``.
    """
    if qtype == QType.Q8_0:  # [d: f16][32 x int8]
        b = _blocks(data, 34)
        return (_f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()).reshape(-1)
    if qtype == QType.Q4_0:  # [d: f16][16 bytes of nibbles], w = d * (q - 8)
        b = _blocks(data, 18)
        return (_f16(b, 0) * (_nibbles(b[:, 2:]) - 8.0)).reshape(-1)
    if qtype == QType.Q4_1:  # [d: f16][m: f16][16 bytes of nibbles], w = d * q + m
        b = _blocks(data, 20)
        return (_f16(b, 0) * _nibbles(b[:, 4:]) + _f16(b, 2)).reshape(-1)
    return None


def hf_name(name: str) -> str:
    """Map a GGUF tensor name to its Hugging Face name.

    Raises:
        ModelLoadError: a tensor name this loader does not know.
    """
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _NAMES:
        return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    raise ModelLoadError(f"unknown GGUF tensor {name!r}")


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _config(meta: dict[str, Any], arch: str, vocab: int, tied: bool) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {
        "vocab_size": int(get("vocab_size", vocab)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": tied,
    }


def _fused_groups(names: set[str]) -> list[list[str]]:
    """The Hugging Face names the model fuses into one linear (q/k/v, gate/up), per layer."""
    groups = []
    for name in names:
        if name.endswith("self_attn.q_proj.weight"):
            groups.append([name.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj")])
        elif name.endswith("mlp.gate_proj.weight"):
            groups.append([name, name.replace("gate_proj", "up_proj")])
    return groups


def _lazy_names(reader: GGUFReader) -> set[str]:
    """The 2-D weights the CPU kernels read from their blocks, so the model needs no dense copy:
    every kernel-readable one, except in a fused linear with a part that is not (F16, Q3_K...):
    that linear is re-quantized from dense weights, so all its parts load dense."""
    types = {hf_name(t.name): QType(t.tensor_type) for t in reader.tensors if len(t.shape) == 2}
    lazy = {name for name, qtype in types.items() if qtype in KERNEL_TYPES}
    for group in _fused_groups(set(types)):
        if not all(n in lazy for n in group):
            lazy -= set(group)
    return lazy


def _tensors(
    reader: GGUFReader, arch: str, cfg: dict[str, Any], lazy: set[str]
) -> tuple[dict[str, torch.Tensor], FileWeights]:
    """Dense tensors by Hugging Face name, and the file's weights by type and blocks. The names
    in ``lazy`` get a meta-device placeholder instead of a dense tensor: their blocks are all
    the kernels need (checked finite here, one tensor at a time)."""
    out: dict[str, torch.Tensor] = {}
    file = FileWeights(lazy=bool(lazy))
    for t in reader.tensors:
        qtype = QType(t.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"tensor {t.name}: unsupported quantization type {qtype.name}; supported: "
                f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))}"
            )
        shape = tuple(reversed([int(x) for x in t.shape]))  # ggml ne order is [in, out]
        name = hf_name(t.name)
        heads = None
        if arch in _PERMUTED_ARCHS and t.name.endswith("attn_q.weight"):
            heads = cfg["num_attention_heads"]
        elif arch in _PERMUTED_ARCHS and t.name.endswith("attn_k.weight"):
            heads = cfg["num_key_value_heads"]
        if len(shape) == 2:
            file.types[name] = int(qtype)
        if len(shape) == 2 and qtype in KERNEL_TYPES:  # the raw blocks: the CPU kernels read them
            try:
                raw = _blocks(t.data, BLOCK_BYTES[qtype]).view(shape[0], -1)
            except RuntimeError as exc:
                raise ModelLoadError(f"tensor {t.name}: corrupt data ({exc})") from exc
            raw = raw if heads is None else unpermute_qk(raw, heads)  # moves whole rows
            blocks = QuantBlocks(int(qtype), raw.contiguous(), (shape[0], shape[1]))
            file.blocks[name] = blocks
            if name in lazy:
                if not finite(blocks):
                    raise ModelLoadError(f"tensor {t.name} holds NaN or infinite values")
                out[name] = torch.empty(shape, device="meta")
                continue
        try:
            fast = dequantize_fast(t.data, qtype)
            if fast is None:
                w = torch.from_numpy(np.array(dequantize(t.data, qtype), dtype=np.float32))
            else:
                w = fast
            w = w.reshape(shape)
        except (ValueError, AssertionError, RuntimeError) as exc:
            raise ModelLoadError(f"tensor {t.name}: corrupt data ({exc})") from exc
        if heads is not None:
            w = unpermute_qk(w, heads)
        out[name] = w.contiguous()  # both paths copied off the mmap
    return out, file


def _tokenizer(meta: dict[str, Any]) -> Tokenizer:
    try:
        return build_gguf_tokenizer(
            str(meta.get("tokenizer.ggml.model")),
            meta.get("tokenizer.ggml.pre"),
            meta["tokenizer.ggml.tokens"],
            meta.get("tokenizer.ggml.token_type") or [],
            meta.get("tokenizer.ggml.merges") or [],
        )
    except KeyError as exc:
        raise ModelLoadError(f"GGUF has no tokenizer metadata ({exc})") from exc
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from exc


def is_four_bit(file: FileWeights) -> bool:
    """True when most 2-D weights are Q4_0/Q4_1: int4 CPU kernels then lose (almost) nothing."""
    four = sum(t in (QType.Q4_0, QType.Q4_1) for t in file.types.values())
    return four * 2 > len(file.types)


def is_quantized(file: FileWeights) -> bool:
    """True when most 2-D weights are in a quantized type (not F32 / F16 / BF16)."""
    dense = {int(QType.F32), int(QType.F16), int(QType.BF16)}
    quantized = sum(t not in dense for t in file.types.values())
    return quantized * 2 > len(file.types)


def load_gguf(
    path: Path, name: str, *, lazy: bool = False
) -> tuple[LlamaModel, Tokenizer, ModelCard, FileWeights]:
    """Load a GGUF file into an fp32 CPU model, its tokenizer, its card, and what the file holds
    for each 2-D weight (its type, and the raw blocks of the types the CPU kernels read).

    ``lazy``: the caller will run the model on the CPU kernels (``QuantizedLlama``), so when the
    file is quantized and the model's widths fit the kernels, the weights the kernels read from
    their blocks load as meta-device placeholders, never as dense fp32 (``FileWeights.lazy``
    says so; such a model cannot run its own forward).

    Raises:
        ModelLoadError: unreadable file, unknown architecture or tensor, unsupported quant type,
            wrongly shaped or non-finite tensor, or unsupported tokenizer.
    """
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises bare ValueError/OSError/struct errors on bad files
        raise ModelLoadError(f"cannot read GGUF {str(path)!r}: {exc}") from exc
    meta = read_metadata(reader)
    arch = str(meta.get("general.architecture"))
    model_cls = MODELS.get(arch)
    if model_cls is None:
        raise ModelLoadError(
            f"unknown architecture {arch!r} in {path.name}; supported: {', '.join(sorted(MODELS))}"
        )
    tokenizer = _tokenizer(meta)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError("GGUF rope_freqs (Llama 3.1 rope scaling) is not supported")
    try:
        cfg = _config(meta, arch, tokenizer.get_vocab_size(), tied="output.weight" not in names)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path.name}: missing or bad {arch}.* hyper-parameters") from exc
    with torch.device("meta"):  # weights come from the file: skip random init
        model = model_cls(model_cls.config_from_hf(cfg))
    try:
        lazy_names = set()
        if lazy and fits(model.config):
            lazy_names = _lazy_names(reader)
            if len(lazy_names) * 2 <= sum(len(t.shape) == 2 for t in reader.tensors):
                lazy_names = set()  # a mostly dense file: dtype=auto keeps it dense
        tensors, file = _tensors(reader, arch, cfg, lazy_names)
        model.load_hf_weights(tensors)
        del tensors  # the unfused q/k/v, gate and up: freed before the caller packs anything
    except WeightError as exc:
        raise ModelLoadError(f"{path.name}: {exc}") from exc
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    eos_ids = [i for i in (eos, token("eot_token_id"), token("eom_token_id")) if i is not None]
    card = build_card(
        name=name,
        architecture=arch,
        context_length=model.config.context_length,
        tokenizer=tokenizer,
        chat_template=str(meta.get("tokenizer.chat_template") or ""),
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        source=str(path),
    )
    return model, tokenizer, card, file
