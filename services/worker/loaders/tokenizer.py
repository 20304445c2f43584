"""Build a ``tokenizers.Tokenizer`` from GGUF ``tokenizer.ggml.*`` metadata.

Owns the mapping from llama.cpp's pre-tokenizer names to Hugging Face pre-tokenizers. Unknown
names raise instead of defaulting: a wrong pre-tokenizer gives plausible but different token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

__all__ = ["PRE_TOKENIZERS", "TokenizerError", "build_gguf_tokenizer"]

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing or uses something unsupported."""


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=True, use_regex=False
                ),
            ]
        )

    return build


def _smollm() -> pre_tokenizers.PreTokenizer:
    # llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM: {"\p{N}", GPT-2 regex}.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "gpt2": _byte_level,
    "smollm": _smollm,
    "llama-bpe": _split_then_bytes(_LLAMA3),
    "llama3": _split_then_bytes(_LLAMA3),
    "qwen2": _split_then_bytes(_QWEN2),
}


def build_gguf_tokenizer(
    model: str,
    pre: str | None,
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[str],
) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer from GGUF vocabulary, merges and token types.

    Args:
        model: ``tokenizer.ggml.model`` (only ``gpt2``, byte-level BPE, is supported).
        pre: ``tokenizer.ggml.pre``, mapped through ``PRE_TOKENIZERS``.
        tokens: ``tokenizer.ggml.tokens``, already in GPT-2 byte-level spelling.
        token_types: ``tokenizer.ggml.token_type`` (3 = control, 4 = user defined).
        merges: ``tokenizer.ggml.merges`` as ``"a b"`` strings.

    Returns:
        A tokenizer whose control tokens are special and keep their GGUF ids.

    Raises:
        TokenizerError: unsupported tokenizer model or pre-tokenizer name.
    """
    if model != "gpt2":
        raise TokenizerError(f"unsupported GGUF tokenizer model {model!r} (only 'gpt2' BPE)")
    build_pre = PRE_TOKENIZERS.get(pre or "default")
    if build_pre is None:
        raise TokenizerError(
            f"unknown tokenizer.ggml.pre {pre!r}; known: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs: list[tuple[str, str]] = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    tk = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tk.pre_tokenizer = build_pre()
    tk.decoder = decoders.ByteLevel()
    special = [i for i, kind in enumerate(token_types) if kind == CONTROL]
    user = [i for i, kind in enumerate(token_types) if kind == USER_DEFINED]
    # Existing strings keep their vocabulary ids when added.
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    for i in special + user:
        if tk.token_to_id(tokens[i]) != i:
            raise TokenizerError(f"added token {tokens[i]!r} did not keep id {i}")
    return tk
