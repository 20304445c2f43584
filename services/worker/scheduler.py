"""The continuous-batching decode loop: one thread, many sequences, one forward per step.

Owns slot admission (with prefix reuse and the cached-token budget), chunked prefill
interleaved with decode steps, token choice (forced marker, penalties, EOS masking, sampling,
logprobs), stop conditions, and freeing slots the moment a sequence finishes or is cancelled.
Events go back to each sequence's asyncio queue through ``loop.call_soon_threadsafe``; the
asyncio side (``torch_backend.TorchBackend``) never touches tensors. Knows nothing about Redis.

The budget: each sequence reserves the most tokens it can ever cache (prompt + resume + the
tokens it may still generate, capped at the context), so a running sequence never runs out of
room and nothing needs preempting. A pending sequence is admitted, in arrival order, only when a
slot is free and its reservation fits beside the running ones; otherwise it waits (it is not
rejected) until finishing sequences give their reservations back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from tokenizers import Tokenizer

from services.worker.constrain import Constrainer, ConstraintState, PendingMasks
from services.worker.kv_cache import KVCache, build_batch, common_prefix
from services.worker.models.llama import LlamaConfig
from services.worker.sampling import (
    SamplingConfig,
    apply_penalties,
    mask_tokens,
    sample_next_token,
    token_logprob,
)
from shared.events import AnyEvent, FinishReason, Start, TokenLogprob
from shared.jobs import Job

__all__ = ["DecoderLike", "Scheduler", "SequenceState"]

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds how long decoding sequences wait


class DecoderLike(Protocol):
    """What the scheduler needs from ``services.worker.parsing.decoder.OutputDecoder``."""

    stop_reason: FinishReason | None

    def feed(self, token_id: int, logprob: TokenLogprob | None = None) -> list[AnyEvent]: ...
    def forced_next_token(self) -> int | None: ...
    def resume(self, token_ids: list[int]) -> None: ...
    def finish(self, reason: FinishReason) -> list[AnyEvent]: ...


DecoderFactory = Callable[[Job, int, int, bool], DecoderLike]
Emit = Callable[[list[AnyEvent] | BaseException], None]


@dataclass(eq=False)
class SequenceState:
    """One request's state inside the loop. Mutated only by the loop thread after submission."""

    job: Job
    prompt: list[int]
    resume: list[int]
    attempt: int
    starts_in_reasoning: bool
    sampling: SamplingConfig
    generator: torch.Generator | None
    max_new: int  # generated tokens allowed, resume tokens included
    emit: Emit  # thread-safe delivery to the request's queue
    on_freed: Callable[[], None]  # thread-safe signal that the slot is released
    tokens: list[int] = field(default_factory=list)  # prompt + resume + generated
    slot: int = -1
    kv_len: int = 0  # tokens whose keys/values are in the slot
    cached: int = 0  # prompt tokens reused from an earlier sequence
    generated: int = 0
    decoder: DecoderLike | None = None
    counts: torch.Tensor | None = None  # (V,) generated-token counts, only when penalised
    seen: torch.Tensor | None = None  # (V,) bool prompt + generated, for repetition penalty
    cancelled: bool = False
    done: bool = False
    reserved: int = 0  # tokens held against the scheduler's budget while admitted
    constraint: ConstraintState | None = None  # structured output / forced tool call

    @property
    def reservation(self) -> int:
        """The most tokens this sequence can ever have cached (its claim on the budget)."""
        return len(self.prompt) + max(self.max_new, len(self.resume))


Delivery = list[tuple[SequenceState, list[AnyEvent]]]  # event batches to emit, in order


def _emit(out: Delivery) -> None:
    for seq, events in out:
        seq.emit(events)


class Scheduler:
    """Runs the decode loop in its own thread over a fixed number of KV-cache slots."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        *,
        eos_ids: list[int],
        max_batch: int,
        device: torch.device,
        dtype: torch.dtype,
        make_decoder: DecoderFactory,
        max_cached_tokens: int | None = None,
        constrainer: Constrainer | None = None,
    ) -> None:
        """Allocate the cache; call ``start`` to run the loop.

        ``max_cached_tokens`` bounds the sum of the running sequences' reservations
        (None: ``max_batch`` full contexts, i.e. only the slots limit admission).
        ``constrainer`` fills the token masks of sequences that carry a ``constraint``.
        """
        self.constrainer = constrainer
        cfg = cast(LlamaConfig, model.config)  # LlamaModel or a test double with its config
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids
        self.device, self.max_batch, self.make_decoder = device, max_batch, make_decoder
        self.context_length = int(cfg.context_length)
        self.vocab = int(cfg.vocab_size)
        self.max_cached_tokens = max_cached_tokens or max_batch * self.context_length
        self.reserved = 0  # sum of the admitted sequences' reservations
        # Called from the loop thread after each decode step with (seconds, sequences).
        self.on_step: Callable[[float, int], None] | None = None
        self.cache = KVCache(
            layers=cfg.num_layers,
            slots=max_batch,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            max_len=self.context_length,
            dtype=getattr(model, "kv_dtype", dtype),  # the kernels keep halves
            device=device,
            zeroed=not getattr(model, "reads_only_written_kv", False),
        )
        self._cond = threading.Condition()
        self._pending: deque[SequenceState] = deque()
        self._active: list[SequenceState] = []
        self._free = list(range(max_batch))
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> int:
        """Sequences holding a slot."""
        return len(self._active)

    def start(self) -> None:
        """Start the loop thread."""
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="sluice-decode", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; every sequence still in flight gets an exception."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        for seq in [*self._pending, *self._active]:
            seq.emit(RuntimeError("the engine stopped"))
            self._release(seq)
        self._pending.clear()

    def submit(self, seq: SequenceState) -> None:
        """Queue a sequence for admission (thread-safe)."""
        if seq.reservation > self.max_cached_tokens:  # it would wait forever
            raise ValueError(
                f"{seq.reservation} tokens exceed the {self.max_cached_tokens}-token budget"
            )
        with self._cond:
            if self._stop or self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the engine is not running")
            self._pending.append(seq)
            self._cond.notify()

    def cancel(self, seq: SequenceState) -> None:
        """Ask the loop to free ``seq``; ``seq.on_freed`` fires once it has (thread-safe)."""
        with self._cond:
            seq.cancelled = True
            if seq in self._pending:  # never admitted: nothing to free in the loop
                self._pending.remove(seq)
                seq.done = True
                seq.on_freed()
            elif self._thread is None or not self._thread.is_alive():
                self._release(seq)
            self._cond.notify()

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stop and not self._pending and not self._active:
                        self._cond.wait()
                    if self._stop:
                        return
                    self._admit()
                try:
                    self._step()
                except Exception as exc:  # thread boundary: fail the batch, keep serving
                    log.exception("decode step failed")
                    for seq in list(self._active):
                        seq.emit(exc)
                        self._release(seq)

    @property
    def waiting(self) -> int:
        """Sequences submitted but not yet admitted (no slot, or no room in the budget)."""
        return len(self._pending)

    def _admit(self) -> None:
        """Move pending sequences into free slots, preferring the slot with the longest prefix.

        Strictly in arrival order: a large request at the head waits for room rather than being
        overtaken forever by small ones.
        """
        while self._pending and self._free:
            if self.reserved + self._pending[0].reservation > self.max_cached_tokens:
                return
            seq = self._pending.popleft()
            seq.reserved = seq.reservation
            self.reserved += seq.reserved
            seq.tokens = [*seq.prompt, *seq.resume]
            limit = min(len(seq.tokens) - 1, len(seq.prompt))  # prefill at least one token
            best = max(
                self._free, key=lambda s: (common_prefix(self.cache.tokens[s], seq.tokens), -s)
            )
            self._free.remove(best)
            seq.slot = best
            seq.cached = min(common_prefix(self.cache.tokens[best], seq.tokens), limit)
            seq.kv_len = seq.cached
            self.cache.tokens[best] = []
            self._active.append(seq)

    def _release(self, seq: SequenceState) -> None:
        if seq in self._active:
            self._active.remove(seq)
            self.reserved -= seq.reserved
            seq.reserved = 0
            self.cache.tokens[seq.slot] = seq.tokens[: seq.kv_len]
            self._free.append(seq.slot)
            self._free.sort()
        if not seq.done:
            seq.done = True
        seq.on_freed()

    def _step(self) -> None:
        for seq in [s for s in self._active if s.cancelled]:
            self._release(seq)
        prefilling = [s for s in self._active if s.decoder is None]
        if prefilling:
            self._confined(prefilling[0], self._prefill_chunk, prefilling[0])
        decoding = [s for s in self._active if s.decoder is not None and not s.done]
        if decoding:
            self._decode(decoding)

    def _prefill_chunk(self, seq: SequenceState) -> None:
        end = min(len(seq.tokens), seq.kv_len + PREFILL_CHUNK)
        chunk = seq.tokens[seq.kv_len : end]
        self.cache.reserve(end)
        batch = build_batch([seq.slot], [seq.kv_len], len(chunk), self.device)
        idx = torch.tensor([chunk], dtype=torch.long, device=self.device)
        last = end == len(seq.tokens)
        pending = self._begin_masks([seq]) if last else None  # filled during the forward
        logits = self.model(idx, batch, self.cache, n_logits=1)  # (1, 1, V)
        seq.kv_len = end
        if not last:
            return
        seq.decoder = self.make_decoder(
            seq.job, len(seq.prompt), seq.cached, seq.starts_in_reasoning
        )
        # The lost worker's tokens were published: rebuild the decoder's state without
        # re-emitting anything it would still hold back (no duplicated text on the stream).
        seq.decoder.resume(seq.resume)
        for token in seq.resume:
            self._count(seq, token)
        seq.generated = len(seq.resume)
        start = Start(
            request_id=seq.job.request_id,
            model=seq.job.model,
            prompt_tokens=len(seq.prompt),
            cached_tokens=seq.cached,
            attempt=seq.attempt,
        )
        out: Delivery = []
        self._advance(seq, self._masked(logits[:, -1], pending)[0], [start], out)
        _emit(out)

    def _decode(self, seqs: list[SequenceState]) -> None:
        began = time.perf_counter()
        self.cache.reserve(max(s.kv_len for s in seqs) + 1)
        batch = build_batch([s.slot for s in seqs], [s.kv_len for s in seqs], 1, self.device)
        idx = torch.tensor(
            [[s.tokens[s.kv_len]] for s in seqs], dtype=torch.long, device=self.device
        )
        pending = self._begin_masks(seqs)  # step N's masks, filled while the model runs step N
        logits = self.model(idx, batch, self.cache, n_logits=1)[:, -1]  # (B, V)
        for seq in seqs:
            seq.kv_len += 1
        rows = self._masked(logits, pending).cpu()
        # The step's batches go out together once every sequence has its token: the event loop
        # then wakes their publishers in one turn, and the worker sends the step as one pipeline
        # (``PublishPipe``) instead of a round trip per sequence.
        out: Delivery = []
        try:
            for i, seq in enumerate(seqs):
                self._confined(seq, self._advance, seq, rows[i], [], out)
        finally:
            _emit(out)
        if self.on_step is not None:
            self.on_step(time.perf_counter() - began, len(seqs))

    def _confined(self, seq: SequenceState, work: Callable[..., None], *args: Any) -> None:
        """Run one sequence's share of a step; if it raises (a prefill, sampling, detokenizing,
        parsing), that sequence alone ends with the exception and the batch goes on."""
        try:
            work(*args)
        except Exception as exc:
            log.exception("%s: sequence failed", seq.job.request_id)
            self._release(seq)
            seq.emit(exc)

    # -- token choice -----------------------------------------------------------------------

    def _begin_masks(self, seqs: list[SequenceState]) -> PendingMasks | None:
        if self.constrainer is None:
            return None
        return self.constrainer.begin([s.constraint for s in seqs])

    def _masked(self, logits: torch.Tensor, pending: PendingMasks | None) -> torch.Tensor:
        if pending is None or self.constrainer is None:
            return logits
        return self.constrainer.apply(logits, pending)

    def _count(self, seq: SequenceState, token: int) -> None:
        if seq.counts is not None:
            seq.counts[token] += 1
        if seq.seen is not None:
            seq.seen[token] = True

    def _choose(self, seq: SequenceState, logits: torch.Tensor) -> int:
        assert seq.decoder is not None
        forced = seq.decoder.forced_next_token()
        if forced is not None:
            return forced
        logits = logits.float().cpu()
        cfg = seq.sampling
        if seq.counts is not None and seq.seen is not None:
            logits = apply_penalties(logits, seq.counts, seq.seen, cfg)
        free = seq.constraint is None or not seq.constraint.active  # a grammar decides the end
        if free and (seq.job.ignore_eos or seq.generated < seq.job.min_tokens):
            logits = mask_tokens(logits, [i for i in self.eos_ids if i < logits.numel()])
        return sample_next_token(logits, cfg, seq.generator)

    def _advance(
        self, seq: SequenceState, logits: torch.Tensor, events: list[AnyEvent], out: Delivery
    ) -> None:
        """Choose, feed and account one token; finish the sequence when a stop condition holds.
        The sequence's events go to ``out``, which the caller emits."""
        assert seq.decoder is not None
        token = self._choose(seq, logits)
        k = seq.job.sampling.top_logprobs
        logprob = (
            token_logprob(logits, token, k, self.tokenizer) if seq.job.sampling.logprobs else None
        )
        events.extend(seq.decoder.feed(token, logprob))
        if seq.constraint is not None:
            seq.constraint.feed(token)
        seq.tokens.append(token)
        seq.generated += 1
        self._count(seq, token)
        reason: FinishReason | None = seq.decoder.stop_reason
        if reason is None and (
            seq.generated >= seq.max_new or len(seq.tokens) >= self.context_length
        ):
            reason = "max_tokens"
        if reason is None and seq.constraint is not None and seq.constraint.complete:
            reason = "end_turn"  # the grammar allows nothing but the end: spare the EOS step
        if reason is not None:
            events.extend(seq.decoder.finish(reason))
            self._release(seq)  # before emitting: a caller that saw Finish sees a free slot
        if events:
            out.append((seq, events))
