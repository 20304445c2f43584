"""Load a Hugging Face model directory: config, safetensors (single or sharded), tokenizer files.

Owns reading ``config.json``, ``model.safetensors[.index.json]``, ``tokenizer.json``,
``tokenizer_config.json`` (chat template, special tokens, add_bos_token) and
``generation_config.json`` (eos ids, default sampling).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from services.worker.loaders import ModelLoadError, build_card
from services.worker.models import MODELS
from services.worker.models.llama import LlamaModel, WeightError
from shared.model_card import ModelCard

__all__ = ["load_hf_dir"]


def _json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"missing {path.name} in {str(path.parent)!r}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _token_text(value: object) -> str | None:
    """tokenizer_config writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if isinstance(value, str) else None


def _chat_template(directory: Path, tok_cfg: dict[str, Any]) -> str:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not template and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return str(template or "")


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_json(index, required=True).get("weight_map", {}).values()))
    else:
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"no *.safetensors weights in {str(directory)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = directory / shard
        if not path.is_file():
            raise ModelLoadError(f"missing weight shard {shard} in {str(directory)!r}")
        try:
            tensors.update({k: v.float() for k, v in load_file(path).items()})
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"corrupt weight file {shard}: {exc}") from exc
    return tensors


def load_hf_dir(directory: Path, name: str) -> tuple[LlamaModel, Tokenizer, ModelCard]:
    """Load a Hugging Face directory into an fp32 CPU model, its tokenizer and its card.

    Raises:
        ModelLoadError: a missing or malformed file, unknown architecture, bad tensor.
    """
    cfg = _json(directory / "config.json", required=True)
    keys = [*cfg.get("architectures", []), cfg.get("model_type")]
    model_cls = next((MODELS[k] for k in keys if k in MODELS), None)
    if model_cls is None:
        raise ModelLoadError(
            f"unknown architecture {keys} in {directory}/config.json; supported: "
            f"{', '.join(sorted(MODELS))}"
        )
    tok_path = directory / "tokenizer.json"
    if not tok_path.is_file():
        raise ModelLoadError(f"missing tokenizer.json in {str(directory)!r}")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"cannot parse {tok_path}: {exc}") from exc
    tok_cfg = _json(directory / "tokenizer_config.json", required=False)
    gen = _json(directory / "generation_config.json", required=False)
    try:
        config = model_cls.config_from_hf(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json: missing or bad field {exc}") from exc
    with torch.device("meta"):  # weights come from the file: skip random init
        model = model_cls(config)
    try:
        model.load_hf_weights(_safetensors(directory))
    except WeightError as exc:
        raise ModelLoadError(f"{directory.name}: {exc}") from exc
    bos = _token_text(tok_cfg.get("bos_token"))
    eos = _token_text(tok_cfg.get("eos_token"))
    eos_ids = gen.get("eos_token_id", cfg.get("eos_token_id"))
    ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        ids.append(tokenizer.token_to_id(eos))
    card = build_card(
        name=name,
        architecture=str(keys[0]),
        context_length=config.context_length,
        tokenizer=tokenizer,
        chat_template=_chat_template(directory, tok_cfg),
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=[int(i) for i in dict.fromkeys(ids)],
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        source=str(directory),
        temperature=gen.get("temperature") if gen.get("do_sample", True) else None,
        top_p=gen.get("top_p"),
        top_k=gen.get("top_k"),
    )
    return model, tokenizer, card
