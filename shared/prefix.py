"""A prompt's prefix, block by block: the hash chain the KV cache and the queue both key on.

A full block of ``block_size`` tokens is known by a hash chain (vLLM's automatic prefix caching
scheme): its hash covers its predecessor's hash and its own tokens, so equal hashes mean equal
whole prefixes. The chain starts from a root salted with the model, so two models never share a
block. SHA-256 (truncated to 16 bytes) rather than Python's ``hash``: a colliding block would
hand one tenant's keys and values to another's prompt, and a 64-bit non-cryptographic hash can
be collided on purpose.

The worker's prefix cache (``services/worker/block_pool.py``) names its blocks with it, and the
API computes the same chain for a job's prompt token ids, so the queue can prefer the worker
that already holds the longest part of it (``services/queue/affinity.py``). One function for
both: a second copy that drifted by one byte would make every preference a miss.
"""

from __future__ import annotations

import hashlib
from array import array

__all__ = ["chain_hashes", "prompt_chain", "root_hash"]


def root_hash(model: str) -> bytes:
    """The chain's root for ``model``: no block of another model can ever match."""
    return hashlib.sha256(b"sluice-kv\0" + model.encode()).digest()[:16]


def chain_hashes(
    tokens: list[int], upto: int, block_size: int, parents: list[bytes], root: bytes
) -> None:
    """Extend ``parents`` (the hashes of the first ``len(parents)`` blocks of ``tokens``) with the
    hash of every further full block within ``tokens[:upto]``."""
    prev = parents[-1] if parents else root
    for start in range(len(parents) * block_size, upto - block_size + 1, block_size):
        ids = array("q", tokens[start : start + block_size]).tobytes()
        prev = hashlib.sha256(prev + ids).digest()[:16]
        parents.append(prev)


def prompt_chain(model: str, tokens: list[int], block_size: int) -> list[bytes]:
    """The hashes of every full block of ``tokens`` (a prompt of ``model``), first block first.

    Args:
        model: the served model id (the worker's card name).
        tokens: the prompt's token ids.
        block_size: tokens per KV block (``SLUICE_KV_BLOCK_SIZE``).

    Returns:
        One 16-byte hash per full block; a partial last block has none.
    """
    out: list[bytes] = []
    chain_hashes(tokens, len(tokens), block_size, out, root_hash(model))
    return out
