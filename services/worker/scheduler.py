"""The continuous-batching decode loop: one thread, many sequences, one forward per step.

Owns the loop: each step admits what the paged cache can hold, asks the planner
(``paging.Planner``) for the step's rows (every decoding sequence's next token plus prompt
chunks within ``max_batched_tokens``), runs them as one forward, and turns the logits into
tokens (forced marker, penalties, EOS masking, sampling, logprobs), stop conditions and events;
a sequence's blocks are freed the moment it finishes or is cancelled. Events go back through
each sequence's ``emit`` (on the worker, the ``handoff.Outbox`` to the event loop); the asyncio
side (``torch_backend.TorchBackend``) never touches tensors. Knows nothing about Redis.

A step mixes decode rows and prompt chunks in one forward, so a long prompt arriving while
streams decode costs each of them a slightly longer step rather than a stall for the whole
prompt. Greedy output does not depend on any of it: the kernels compute a token's keys, values
and logits to the same bits whatever batch, chunk, block table or prefix-cache hit it came from.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from tokenizers import Tokenizer

from services.worker.block_pool import root_hash
from services.worker.constrain import Constrainer, PendingMasks
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.kv_cache import PagedKVCache, build_batch
from services.worker.models.llama import LlamaConfig
from services.worker.paging import Planner
from services.worker.sequence import DecoderFactory, DecoderLike, SequenceState
from services.worker.speculation import Speculator, forward_rows, split_logits
from services.worker.token_choice import TokenChooser
from shared.events import AnyEvent, FinishReason, Start, TokenLogprob

__all__ = ["DecoderFactory", "DecoderLike", "Scheduler", "SequenceState"]

log = logging.getLogger(__name__)

Delivery = list[tuple[SequenceState, list[AnyEvent]]]  # event batches to emit, in order


def _emit(out: Delivery) -> None:
    for seq, events in out:
        seq.emit(events)


class Scheduler:
    """Runs the decode loop in its own thread over a paged KV cache."""

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
        num_blocks: int,
        block_size: int = 16,
        max_batched_tokens: int = 256,
        stall: float = 0.0,
        model_id: str = "",
        constrainer: Constrainer | None = None,
        cuda_graphs: bool = False,
        speculative_tokens: int = 0,
    ) -> None:
        """Allocate the cache (``num_blocks`` of ``block_size`` tokens); call ``start`` to run.

        ``max_batch`` caps running sequences, ``max_batched_tokens`` a step's new tokens;
        ``stall`` bounds a step that reads prompts beside decoding streams to that many times a
        decode-only step (``paging.StallGuard``; 0: the token budget alone);
        ``model_id`` salts the prefix cache's hashes; ``constrainer`` fills the token masks of
        sequences that carry a ``constraint``; ``cuda_graphs`` replays decode steps on a GPU
        from graphs captured by ``start`` (``cuda_graphs.DecodeGraphs``); ``speculative_tokens``
        > 0 verifies that many prompt-lookup draft tokens a step (``speculation.py``).
        """
        self.constrainer = constrainer
        cfg = cast(LlamaConfig, model.config)  # LlamaModel or a test double with its config
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids
        self.device, self.max_batch, self.make_decoder = device, max_batch, make_decoder
        self.context_length = int(cfg.context_length)
        self.vocab = int(cfg.vocab_size)
        # Called from the loop thread after each step with (seconds, sequences).
        self.on_step: Callable[[float, int], None] | None = None
        self.cache = PagedKVCache(
            layers=cfg.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=getattr(model, "kv_dtype", dtype),  # the kernels keep halves
            device=device,
            zeroed=not getattr(model, "reads_only_written_kv", False),
        )
        self.planner = Planner(
            self.cache,
            max_batch=max_batch,
            max_batched_tokens=max_batched_tokens,
            root=root_hash(model_id),
            stall=stall,
        )
        on_gpu = device.type == "cuda"
        self.chooser = TokenChooser(eos_ids, tokenizer, on_device=on_gpu)
        self.speculator = Speculator(speculative_tokens) if speculative_tokens > 0 else None
        self.graphs: DecodeGraphs | None = None
        if on_gpu and cuda_graphs and self.cache.paged_kernel:
            width = -(-min(self.context_length, self.cache.tokens) // block_size)
            self.graphs = DecodeGraphs(model, self.cache, max_batch=max_batch, max_blocks=width)
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def max_cached_tokens(self) -> int:
        """The pool's capacity in tokens: no single sequence may need more."""
        return self.cache.tokens

    @property
    def max_batched_tokens(self) -> int:
        """New tokens one step may compute (decode rows first, then prompt chunks)."""
        return self.planner.max_batched_tokens

    @max_batched_tokens.setter
    def max_batched_tokens(self, value: int) -> None:
        self.planner.max_batched_tokens = value

    @property
    def active(self) -> int:
        """Sequences admitted (holding blocks, or about to)."""
        return len(self.planner.active)

    @property
    def waiting(self) -> int:
        """Sequences submitted but not running (queued, or preempted until blocks free up)."""
        return len(self.planner.pending)

    @property
    def kv_usage(self) -> float:
        """The share of the pool's blocks held by running sequences (0..1)."""
        return self.cache.pool.used / self.cache.num_blocks

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (each resumes when blocks free up)."""
        return self.planner.preemptions

    def start(self) -> None:
        """Start the loop thread (capturing the decode graphs first, once)."""
        if self.graphs is not None and not self.graphs.graphs:
            with torch.inference_mode():
                self.graphs.capture()
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
        for seq in [*self.planner.pending, *self.planner.active]:
            seq.emit(RuntimeError("the engine stopped"))
            self._release(seq)
        self.planner.pending.clear()

    def submit(self, seq: SequenceState) -> None:
        """Queue a sequence for admission (thread-safe)."""
        if seq.capacity > self.max_cached_tokens:  # it would wait forever
            raise ValueError(
                f"{seq.capacity} tokens exceed the {self.max_cached_tokens}-token KV cache"
            )
        with self._cond:
            if self._stop or self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the engine is not running")
            self.planner.pending.append(seq)
            self._cond.notify()

    def cancel(self, seq: SequenceState) -> None:
        """Ask the loop to free ``seq``; ``seq.on_freed`` fires once it has (thread-safe)."""
        with self._cond:
            seq.cancelled = True
            if seq in self.planner.pending:  # queued or preempted: it holds no blocks
                self.planner.pending.remove(seq)
                seq.done = True
                seq.on_freed()
            elif self._thread is None or not self._thread.is_alive():
                self._release(seq)
            self._cond.notify()

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (thread-safe; running sequences keep their blocks)."""
        with self._cond:
            self.cache.pool.clear_cache()

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stop and not self.planner.pending and not self.planner.active:
                        self._cond.wait()
                    if self._stop:
                        return
                    for seq in [s for s in self.planner.active if s.cancelled]:
                        self._release(seq)
                    self.planner.admit()
                    rows = self.planner.plan()
                    if rows and self.speculator is not None:
                        rows = self.speculator.propose(rows, self.planner, self.context_length)
                try:
                    if rows:
                        self._step(rows)
                    elif self.planner.active:  # every one waits on a block another computes
                        time.sleep(0.001)
                except Exception as exc:  # thread boundary: fail the batch, keep serving
                    log.exception("decode step failed")
                    with self._cond:
                        for seq in list(self.planner.active):
                            seq.emit(exc)
                            self._release(seq)

    def _release(self, seq: SequenceState) -> None:
        self.planner.release(seq)
        seq.done = True
        seq.on_freed()

    def _step(self, rows: list[tuple[SequenceState, int]]) -> None:
        began = time.perf_counter()
        spans, ids = forward_rows(rows)
        chosen = [s for (s, _), p in zip(rows, spans, strict=True) if p.logits]  # in row order
        sampled = [s for s in chosen if not s.draft]
        pending: PendingMasks | None = None  # a constrained step's masks, filled as it runs
        if self.constrainer is not None:
            pending = self.constrainer.begin(
                [s.constraint for s in chosen], [s.draft for s in chosen]
            )
        if self.graphs is not None and len(ids) == len(rows) <= self.graphs.max_rows:
            logits = self.graphs.run(ids, spans)  # a decode step: replayed
            if len(sampled) < len(spans):  # a resumed prompt re-read a token at a time
                logits = logits[[i for i, s in enumerate(spans) if s.logits]]
        else:
            batch = build_batch(spans, self.cache.block_size, self.device)
            idx = torch.tensor(ids, dtype=torch.long, device=self.device)
            logits = self.model(idx, batch, self.cache)  # (len(sampled), V)
        decode_rows = sum(n for s, n in rows if n == 1 or s.draft)
        if not self.chooser.on_device:  # on a GPU the forward is only queued by now
            self.planner.guard.observe(
                time.perf_counter() - began, decode_rows, len(ids) - decode_rows
            )
        with self._cond:
            for seq, n in rows:
                if not seq.draft:  # a draft's rows are committed as they are accepted
                    self.planner.commit(seq, n)
        # The step's batches go out together once every sequence has its token: the event loop
        # then wakes their publishers in one turn, and the worker sends the step as one pipeline
        # (``PublishPipe``) instead of a round trip per sequence.
        out: Delivery = []
        try:
            if pending is not None and self.constrainer is not None:
                logits = self.constrainer.apply(logits, pending)  # before a matcher moves on
            if self.speculator is not None and any(s.draft for s, _ in rows):
                logits, drafted = split_logits(rows, spans, logits)
                for seq, mine in drafted:
                    self._confined(seq, self._accept, seq, mine, out)
            if sampled:
                self._sample(sampled, logits, out)
        finally:
            _emit(out)
        if self.chooser.on_device:  # the step's tokens reached the host: its time is known
            self.planner.guard.observe(
                time.perf_counter() - began, decode_rows, len(ids) - decode_rows
            )
        took = time.perf_counter() - began
        if self.speculator is not None:
            self.speculator.observe(took)
        if self.on_step is not None:
            self.on_step(took, len(rows))

    def _sample(self, seqs: list[SequenceState], logits: torch.Tensor, out: Delivery) -> None:
        """Choose each sequence's next token from its row of ``logits`` and advance it."""
        started: dict[SequenceState, list[AnyEvent]] = {}
        for seq in seqs:
            self._confined(seq, self._start, seq, started)
        if self.chooser.on_device:
            live = [i for i, s in enumerate(seqs) if s in started]
            if not live:
                return
            rows = logits if len(live) == len(seqs) else logits[live]
            choices = self.chooser.batch([seqs[i] for i in live], rows)
            for i, (token, logprob) in zip(live, choices, strict=True):
                seq = seqs[i]
                self._confined(seq, self._advance, seq, token, logprob, started[seq], out)
            return
        rows = logits.cpu()
        for i, seq in enumerate(seqs):
            if seq in started:
                self._confined(seq, self._choose_one, seq, rows[i], started[seq], out)

    def _start(self, seq: SequenceState, started: dict[SequenceState, list[AnyEvent]]) -> None:
        """The first time ``seq``'s prompt is done: start its decoder, and its stream."""
        events: list[AnyEvent] = []
        if seq.decoder is None:
            seq.decoder = self.make_decoder(
                seq.job, len(seq.prompt), seq.cached, seq.starts_in_reasoning
            )
            # The lost worker's tokens were published: rebuild the decoder's state without
            # re-emitting anything it would still hold back (no duplicated text on the stream).
            seq.decoder.resume(seq.resume)
            for token in seq.resume:
                self.chooser.count(seq, token)
            seq.generated = len(seq.resume)
            events.append(
                Start(
                    request_id=seq.job.request_id,
                    model=seq.job.model,
                    prompt_tokens=len(seq.prompt),
                    cached_tokens=seq.cached,
                    attempt=seq.attempt,
                )
            )
        started[seq] = events

    def _choose_one(
        self, seq: SequenceState, logits: torch.Tensor, events: list[AnyEvent], out: Delivery
    ) -> None:
        token, logprob = self.chooser.one(seq, logits)
        self._advance(seq, token, logprob, events, out)

    def _accept(self, seq: SequenceState, logits: torch.Tensor, out: Delivery) -> None:
        """Choose ``seq``'s tokens row by row as one-token steps would, while they match its
        draft; the step's accepted tokens go out as one batch."""
        assert self.speculator is not None
        mine: Delivery = []
        accepted = 0  # draft tokens the model chose too
        for j, row in enumerate(logits):
            with self._cond:  # row j's keys and values belong to a token the model chose
                self.planner.commit(seq, 1)
            token, logprob = self.chooser.row(seq, row)
            self._advance(seq, token, logprob, [], mine)
            if seq.done or j == len(seq.draft) or token != seq.draft[j]:
                break
            accepted += 1
        with self._cond:
            self.speculator.verified(seq, accepted, self.planner)
        out.extend([(seq, [e for _, events in mine for e in events])] if mine else [])

    def _confined(self, seq: SequenceState, work: Callable[..., None], *args: Any) -> None:
        """Run one sequence's share of a step; if it raises (sampling, detokenizing, parsing),
        that sequence alone ends with the exception and the batch goes on."""
        try:
            work(*args)
        except Exception as exc:
            log.exception("%s: sequence failed", seq.job.request_id)
            with self._cond:
                self._release(seq)
            seq.emit(exc)

    def _advance(
        self,
        seq: SequenceState,
        token: int,
        logprob: TokenLogprob | None,
        events: list[AnyEvent],
        out: Delivery,
    ) -> None:
        """Feed and account ``seq``'s next token; finish the sequence when a stop condition
        holds. The sequence's events go to ``out``, which the caller emits."""
        assert seq.decoder is not None
        events.extend(seq.decoder.feed(token, logprob))
        if seq.constraint is not None:
            seq.constraint.feed(token)
        seq.tokens.append(token)
        seq.generated += 1
        self.chooser.count(seq, token)
        reason: FinishReason | None = seq.decoder.stop_reason
        if reason is None and (
            seq.generated >= seq.max_new or len(seq.tokens) >= self.context_length
        ):
            reason = "max_tokens"
        if reason is None and seq.constraint is not None and seq.constraint.complete:
            reason = "end_turn"  # the grammar allows nothing but the end: spare the EOS step
        if reason is not None:
            events.extend(seq.decoder.finish(reason))
            with self._cond:  # before emitting: a caller that saw Finish sees the blocks free
                self._release(seq)
        if events:
            out.append((seq, events))
