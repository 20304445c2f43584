"""The bodies of Ollama's model endpoints, from the cards of the models sluice serves.

``/api/tags`` and ``/api/ps`` list the models with a live worker (as ``/v1/models`` does): a
worker keeps its one model loaded, so "available" and "running" are the same list. Sizes are 0
(the API never sees the weights), the digest is a stable hash of the card's name, source and
load time, and ``details.family`` is the card's architecture. ``/api/show`` gives what clients
read from it: ``capabilities`` (``completion``, plus ``tools`` and ``thinking`` where the card
knows the model's markers), ``model_info`` with ``<architecture>.context_length`` (Open WebUI and
Continue size their prompts from it), the chat template and the default sampling parameters.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from shared.model_card import ModelCard

__all__ = ["VERSION", "ps_body", "show_body", "tags_body"]

# The Ollama release whose API this emulates: clients gate features on it (``think`` needs
# 0.9, tool streaming 0.8), so an older number would switch off what sluice supports.
VERSION = "0.12.0"

# A model stays loaded for the worker's life: Ollama's "never expires" (keep_alive -1).
_NEVER = "2318-01-01T00:00:00Z"


def _modified(card: ModelCard) -> str:
    return datetime.fromtimestamp(card.created, tz=UTC).isoformat().replace("+00:00", "Z")


def _digest(card: ModelCard) -> str:
    return hashlib.sha256(f"{card.name}\0{card.source}\0{card.created}".encode()).hexdigest()


def _details(card: ModelCard) -> dict[str, object]:
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": card.architecture,
        "families": [card.architecture],
        "parameter_size": "",
        "quantization_level": "",
    }


def _entry(card: ModelCard) -> dict[str, object]:
    return {
        "name": card.name,
        "model": card.name,
        "modified_at": _modified(card),
        "size": 0,
        "digest": _digest(card),
        "details": _details(card),
    }


def tags_body(cards: list[ModelCard]) -> dict[str, object]:
    """``GET /api/tags``: the served models."""
    return {"models": [_entry(c) for c in cards]}


def ps_body(cards: list[ModelCard]) -> dict[str, object]:
    """``GET /api/ps``: the loaded models (every served model is loaded)."""
    models = [
        {**_entry(c), "expires_at": _NEVER, "size_vram": 0, "context_length": c.context_length}
        for c in cards
    ]
    return {"models": models}


def _parameters(card: ModelCard) -> str:
    # Modelfile syntax, one "name value" per line, as Ollama shows a model's defaults.
    lines = [
        f"{name} {value}"
        for name, value in (
            ("temperature", card.default_temperature),
            ("top_p", card.default_top_p),
            ("top_k", card.default_top_k),
        )
        if value is not None
    ]
    lines += [f'stop "{card.eos_token}"'] if card.eos_token else []
    return "\n".join(lines)


def show_body(card: ModelCard) -> dict[str, object]:
    """``POST /api/show``: one model's details, template and capabilities."""
    capabilities = ["completion"]
    if card.tools is not None:
        capabilities.append("tools")
    if card.reasoning is not None:
        capabilities.append("thinking")
    return {
        "modelfile": f"FROM {card.source or card.name}\n",
        "parameters": _parameters(card),
        "template": card.chat_template,
        "details": _details(card),
        "model_info": {
            "general.architecture": card.architecture,
            "general.basename": card.name,
            f"{card.architecture}.context_length": card.context_length,
        },
        "capabilities": capabilities,
        "modified_at": _modified(card),
    }
