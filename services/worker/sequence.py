"""One request's state inside the decode loop, and what the loop needs from its decoder.

Owns ``SequenceState``: the tokens a sequence has (prompt, a lost worker's published tokens,
then its own), how many of them have keys and values in the paged cache and in which blocks,
and its sampling and parsing state. Mutated only by the loop thread after submission.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.worker.constrain import ConstraintState
from services.worker.draft_pacing import DraftRecord
from services.worker.drafting import NgramIndex
from services.worker.sampling import SamplingConfig
from shared.events import AnyEvent, FinishReason, TokenLogprob
from shared.jobs import Job

__all__ = ["DecoderFactory", "DecoderLike", "Emit", "SequenceState"]


class DecoderLike(Protocol):
    """What the scheduler needs from ``services.worker.parsing.decoder.OutputDecoder``."""

    stop_reason: FinishReason | None

    def feed(self, token_id: int, logprob: TokenLogprob | None = None) -> list[AnyEvent]: ...
    def forced_next_token(self) -> int | None: ...
    def resume(self, token_ids: list[int]) -> None: ...
    def finish(self, reason: FinishReason) -> list[AnyEvent]: ...


DecoderFactory = Callable[[Job, int, int, bool], DecoderLike]
Emit = Callable[[list[AnyEvent] | BaseException], None]

_keys = itertools.count()


@dataclass(eq=False)
class SequenceState:
    """One request's state inside the loop."""

    job: Job
    prompt: list[int]
    resume: list[int]
    attempt: int
    starts_in_reasoning: bool
    sampling: SamplingConfig
    generator: torch.Generator | None
    max_new: int  # generated tokens allowed, resume tokens included
    emit: Emit  # thread-safe delivery to the request's queue
    on_freed: Callable[[], None]  # thread-safe signal that its blocks are released
    key: int = field(default_factory=lambda: next(_keys))  # stable id in attention batches
    tokens: list[int] = field(default_factory=list)  # prompt + resume + generated
    kv_len: int = 0  # leading tokens whose keys and values are in ``blocks``
    blocks: list[int] = field(default_factory=list)  # block table: position p in p // size
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full token blocks
    registered: int = 0  # leading blocks already known to the prefix cache
    cached: int = 0  # prompt tokens served from the prefix cache at first admission
    preempted: int = 0  # times its blocks were taken back
    generated: int = 0
    decoder: DecoderLike | None = None
    counts: torch.Tensor | None = None  # (V,) generated-token counts, only when penalised
    seen: torch.Tensor | None = None  # (V,) bool prompt + generated, for repetition penalty
    # the device sampler's seed (the request's, else a random one): draws hash (seed, position)
    seed: int = field(default_factory=lambda: random.getrandbits(63))
    cancelled: bool = False
    done: bool = False
    constraint: ConstraintState | None = None  # structured output / forced tool call
    drafter: NgramIndex | None = None  # its n-grams, once it speculates (``speculation.py``)
    pace: DraftRecord | None = None  # how its drafts fared, once it speculates
    draft: list[int] = field(default_factory=list)  # tokens this step verifies after its last

    @property
    def capacity(self) -> int:
        """The most tokens this sequence can ever have cached (prompt, resume, the rest)."""
        return len(self.prompt) + max(self.max_new, len(self.resume))

    @property
    def to_compute(self) -> int:
        """Known tokens without keys and values yet: 1 while decoding, more while prefilling."""
        return len(self.tokens) - self.kv_len
