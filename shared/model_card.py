"""The model card: what a worker publishes so the API can validate and tokenize without weights.

Stored as msgpack in the ``sluice:model:{name}`` hash (field ``card``). The API builds its
tokenizer from ``tokenizer_json`` and renders ``chat_template`` itself.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["ModelCard", "ReasoningMarkers", "ToolMarkers", "decode_card", "encode_card"]


class ReasoningMarkers(msgspec.Struct, frozen=True):
    """A reasoning block's open/close marker tokens, found in the tokenizer's added tokens."""

    open: str  # e.g. "<think>"
    close: str  # e.g. "</think>"
    open_id: int
    close_id: int


class ToolMarkers(msgspec.Struct, frozen=True, kw_only=True):
    """How the model writes tool calls.

    ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen, Hermes).
    ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of calls.
    ``llama3_json``: a bare ``{"name": ..., "parameters": {...}}`` object as the whole reply.
    """

    style: Literal["hermes", "mistral", "llama3_json"]
    open: str | None = None
    close: str | None = None
    open_id: int | None = None
    close_id: int | None = None


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the API needs about a served model."""

    name: str  # public model id
    architecture: str
    context_length: int
    tokenizer_json: str  # tokenizers.Tokenizer.to_str()
    chat_template: str
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: list[int] = []
    add_bos_token: bool = False  # prepend bos id when the template does not write it
    reasoning: ReasoningMarkers | None = None
    tools: ToolMarkers | None = None
    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None
    created: int = 0  # unix seconds the worker loaded it
    source: str = ""  # file or directory the weights came from


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ModelCard)


def encode_card(card: ModelCard) -> bytes:
    """Encode a card for Redis."""
    return _ENCODER.encode(card)


def decode_card(data: bytes) -> ModelCard:
    """Decode a card from Redis."""
    return _DECODER.decode(data)
