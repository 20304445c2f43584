"""Incremental, UTF-8-safe detokenization of one run of tokens.

Decoding token by token breaks multi-byte characters (a byte-level BPE token may hold half of an
emoji) and word-initial spaces (SentencePiece). Like vLLM and TGI, we decode a short window that
starts a few tokens back and emit only the new suffix, holding it while it ends in U+FFFD (an
incomplete UTF-8 sequence). One ``Detokenizer`` covers one segment of output: the decoder starts a
new one whenever a marker token switches channels, because marker text is never emitted.
"""

from __future__ import annotations

import tokenizers

__all__ = ["Detokenizer"]

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns token ids into text increments.

    Args:
        tokenizer: The model's tokenizer.
        skip_special_tokens: Drop special tokens' text (e.g. a stray ``<|im_start|>``).
    """

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: context for the decoder (spaces, byte merges)
        self._read = 0  # tokens before this index have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def step(self, token_id: int) -> str:
        """Add one token; return the text that became final (may be "")."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Return whatever is still held (an incomplete character decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]
