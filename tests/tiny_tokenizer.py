"""A small, real byte-level BPE tokenizer for parsing and prompt tests.

Trained in-process on a fixed corpus (deterministic), with ChatML control tokens as special added
tokens and the reasoning / tool-call markers as non-special added tokens, the way Qwen ships them.
Any text encodes (byte fallback through the 256-symbol byte alphabet), so tests can build token
sequences for arbitrary strings, including multi-byte UTF-8.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["CONTROL", "MARKERS", "tiny_tokenizer"]

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[TOOL_CALLS]", "<|python_tag|>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

_CORPUS = [
    "Hello, world! The user greets me. Hi there.",
    'The weather in Paris is sunny. {"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Once upon a time there was a small model that liked to think before it answered.",
    "1, 2, 3, 4, 5. Let me check the weather for both cities: Paris and Oslo.",
    "café naïve 東京 😀 ünïcödé — “quotes” and emoji 🎉 in arguments",
    "You are a helpful assistant. system user assistant tool",
]


@lru_cache(maxsize=1)
def _base_json() -> str:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    return tok.to_str()


def tiny_tokenizer() -> Tokenizer:
    """A fresh copy of the test tokenizer (callers may mutate flags on it)."""
    return Tokenizer.from_str(_base_json())
