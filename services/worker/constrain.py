"""Grammar-constrained sampling on llguidance: token masks computed beside the forward pass.

Why llguidance: it compiles a JSON schema lazily (under a millisecond to build a matcher for
the schemas the tests use), computes one SmolLM2 mask in ~30 us after the first, works from a
Hugging Face ``tokenizers`` JSON (the model card's), checks grammars without a tokenizer (so
the API validates without building one) and speaks Lark with special-token references, which
is how forced tool calls are written in a model's own syntax (``shared.grammar``).

The scheduler calls ``Constrainer.begin`` for the sequences of a step *before* it runs the
model, so the masks of step N are filled on this module's thread (llguidance's executor drops
the GIL) while torch computes step N's logits; ``apply`` then waits for them and sets every
disallowed logit to -inf on the logits' own device, CPU or CUDA, for the constrained rows only
(free sequences in the same batch are untouched). After sampling, ``ConstraintState.feed``
advances the matcher on the chosen token.

A constraint applies to the answer: tokens inside a reasoning block are free (the matcher does
not see them), and where the model may open a reasoning block itself its open marker is also
allowed as the first answer token (unless the template closed an empty block at the end of the
prompt, its way of switching thinking off). A budget-forced close marker ends the block like any
other, so the answer after it is constrained all the same.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from shared.errors import InvalidRequest
from shared.grammar import job_grammar
from shared.jobs import Job
from shared.model_card import ModelCard, ReasoningMarkers

__all__ = ["Constrainer", "ConstraintState", "MaskStats", "PendingMasks"]

log = logging.getLogger(__name__)

CLOSED_TAIL = 8  # prompt tokens searched for a reasoning block the template closed
CACHE_SIZE = 64  # compiled grammars kept (a cached one costs a deep copy, not a compile)

PendingMasks = Future[tuple[list[int], torch.Tensor]]  # constrained rows, their bitmasks


@dataclass
class MaskStats:
    """Where constrained steps spend their time (seconds, summed; ``ops/bench`` reads them).

    ``fill_s`` runs beside the forward pass; ``wait_s`` (masks not ready when the logits were)
    and ``apply_s`` (unpacking and masking) are what a constrained step adds to its critical path.
    """

    steps: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0


@dataclass(eq=False)
class ConstraintState:
    """One sequence's matcher and where its answer starts (after any reasoning block)."""

    matcher: LLMatcher
    reasoning: ReasoningMarkers | None
    inside: bool  # in a reasoning block: free tokens, the matcher waits
    may_open: bool  # the model may still open a reasoning block before its answer
    started: bool = False  # the matcher has consumed a token
    broken: bool = False  # the matcher failed (logged); the rest of the answer is free

    @property
    def active(self) -> bool:
        """The next token is constrained."""
        return not self.inside and not self.broken

    @property
    def complete(self) -> bool:
        """The grammar is finished: nothing but the end may follow."""
        return self.active and self.started and self.matcher.is_stopped()

    def open_allowed(self) -> int | None:
        """The reasoning open marker, while it may still begin the answer."""
        if self.may_open and not self.started and self.reasoning is not None:
            return self.reasoning.open_id
        return None

    def admits(self, draft: list[int]) -> int:
        """How many leading tokens of ``draft`` (speculative decoding) can be verified with
        masks filled before the forward: in the answer, those the grammar allows; in a
        reasoning block, those before its close marker (the answer's first token needs the
        matcher's mask); at the answer's start, none (its open marker may switch the phase)."""
        if self.broken:
            return len(draft)
        if self.inside:
            close = None if self.reasoning is None else self.reasoning.close_id
            return draft.index(close) if close in draft else len(draft)
        if self.open_allowed() is not None:
            return 0
        return int(self.matcher.validate_tokens(draft))

    def feed(self, token: int) -> None:
        """Account one chosen token: reasoning markers switch phase, answer tokens advance."""
        markers = self.reasoning
        if self.inside:
            if markers is not None and token == markers.close_id:
                self.inside = False
            return
        if markers is not None and token == self.open_allowed():
            self.inside, self.may_open = True, False
            return
        if self.broken:
            return
        self.started = True
        if not self.matcher.consume_token(token):
            self.broken = True
            log.warning("constraint matcher rejected token %d: %s", token, self.matcher.get_error())


class Constrainer:
    """Compiles jobs' grammars (cached) and fills their masks on a thread of its own."""

    def __init__(self, tokenizer_json: str, *, vocab: int, eos_ids: list[int], max_batch: int):
        """Prepare; the llguidance tokenizer is built on the first constrained job (~0.2 s)."""
        self._tokenizer_json, self._eos = tokenizer_json, eos_ids
        self.vocab = vocab
        self._tokenizer: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-mask")
        self._words = (vocab + 31) // 32
        self._masks = torch.full((max_batch, self._words), -1, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.stats = MaskStats()

    def _matcher(self, grammar: str) -> LLMatcher:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab, eos_token=self._eos
                )
                self._executor = LLExecutor()
            pristine = self._cache.get(grammar)
            if pristine is None:
                pristine = LLMatcher(self._tokenizer, grammar, log_level=0)
                if pristine.is_error():
                    raise InvalidRequest(f"the constraint does not compile: {pristine.get_error()}")
                self._cache[grammar] = pristine
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(grammar)
            return pristine.deep_copy()

    def state(
        self, job: Job, card: ModelCard, *, in_reasoning: bool, resume: list[int]
    ) -> ConstraintState | None:
        """The job's constraint state after ``resume`` (None when the job is unconstrained).

        Compiles the grammar (call it off the decode thread). Raises ``InvalidRequest`` when
        the grammar does not compile (the API checks first, so only a hand-made job gets here).
        """
        grammar = job_grammar(job, card)
        if grammar is None:
            return None
        markers = card.reasoning
        # A generation prompt that ends in an empty closed block (``<think>\n\n</think>``) told
        # the model not to think: then its answer must start at once.
        closed = markers is not None and markers.close_id in job.prompt_token_ids[-CLOSED_TAIL:]
        state = ConstraintState(
            matcher=self._matcher(grammar),
            reasoning=markers,
            inside=in_reasoning,
            may_open=markers is not None and job.reasoning.effort != "none" and not closed,
        )
        for token in resume:
            state.feed(token)
        return state

    def begin(
        self, states: list[ConstraintState | None], drafts: list[list[int]] | None = None
    ) -> PendingMasks | None:
        """Start filling the masks of one step's logit rows; None when no row is constrained.

        ``states`` has one entry per sequence with logits, in row order. A sequence with a
        draft (``drafts``, speculative decoding) owns ``1 + len(draft)`` consecutive rows, its
        last token's and each draft token's: row ``j + 1`` is masked as if the draft's first
        ``j + 1`` tokens had been chosen (llguidance consumes them and rolls the matcher back),
        which is the state it is read in, since a row is only used while the draft is accepted.
        The draft must be one the grammar accepts (``ConstraintState.admits``).
        """
        drafts = drafts or [[] for _ in states]
        rows: list[int] = []
        work: list[tuple[ConstraintState, int, list[int]]] = []  # state, its first mask, draft
        at = 0
        for s, draft in zip(states, drafts, strict=True):
            if s is not None and s.active:
                work.append((s, len(rows), draft))
                rows.extend(range(at, at + 1 + len(draft)))
            at += 1 + len(draft)
        if not work:
            return None
        return self._pool.submit(self._fill, rows, work)

    def _fill(
        self, rows: list[int], work: list[tuple[ConstraintState, int, list[int]]]
    ) -> tuple[list[int], torch.Tensor]:
        began = time.perf_counter()
        if len(rows) > self._masks.shape[0]:  # draft rows: more than one a sequence
            self._masks = torch.full((len(rows), self._words), -1, dtype=torch.int32)
        masks = self._masks[: len(rows)]
        assert self._executor is not None
        ptr, size = masks.data_ptr(), self._words * 4
        pairs = [(s.matcher, k) for s, k, draft in work if not draft]
        if pairs:
            self._executor.unsafe_compute_mask_ptr(pairs, ptr, size, len(rows))
        triples = [(s.matcher, k, draft) for s, k, draft in work if draft]  # never empty ones
        if triples:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(triples, ptr, size, len(rows))
        for s, k, _ in work:
            open_id = s.open_allowed()
            if open_id is not None:
                masks[k, open_id // 32] |= 1 << (open_id % 32)
        self.stats.fill_s += time.perf_counter() - began
        return rows, masks

    def apply(self, logits: torch.Tensor, pending: PendingMasks) -> torch.Tensor:
        """Wait for the masks and return ``logits`` (B, V) with disallowed tokens at -inf."""
        began = time.perf_counter()
        rows, masks = pending.result()
        ready = time.perf_counter()
        vocab = logits.shape[-1]
        n = min(vocab, self.vocab)  # ids past the tokenizer (a padded head) are never allowed
        on_cpu = logits.device.type == "cpu"
        if on_cpu and logits.dtype == torch.float32 and logits.is_contiguous():
            # numpy unpacks and masks in place ~5x faster than torch's shift, compare and
            # masked_fill (21 vs ~110 us for one SmolLM2 row, 0.28 vs 1.4 ms for 16).
            unpacked = np.unpackbits(
                masks.numpy().view(np.uint8), axis=1, count=n, bitorder="little"
            )
            allowed = unpacked.view(np.bool_)
            array = logits.numpy()
            if rows == list(range(logits.shape[0])):  # every row constrained: one call
                np.copyto(array[:, :n], -np.inf, where=~allowed)
            else:
                for k, row in enumerate(rows):
                    np.copyto(array[row, :n], -np.inf, where=~allowed[k])
        else:
            words = masks.to(logits.device, non_blocking=True).unsqueeze(-1)
            bits = (words >> self._shifts.to(logits.device)) & 1  # (R, words, 32)
            blocked = bits.reshape(len(rows), -1)[:, :n] == 0
            if rows == list(range(logits.shape[0])):
                logits[:, :n].masked_fill_(blocked, float("-inf"))
            else:
                for k, row in enumerate(rows):
                    logits[row, :n].masked_fill_(blocked[k], float("-inf"))
        if vocab > n:
            logits[rows, n:] = float("-inf")
        # In place: the logits are this step's fresh output, read by nothing else.
        stats = self.stats
        stats.steps += 1
        stats.wait_s += ready - began
        stats.apply_s += time.perf_counter() - ready
        return logits
