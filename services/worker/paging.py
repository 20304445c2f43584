"""Which sequences run, where their keys and values go, and what each step computes.

Owns admission by free blocks, each sequence's block table (prefix-cache hits, blocks allocated
as its tokens need them, full blocks made known to the cache), preemption when the pool runs
dry, and the plan of one step: every decoding sequence's next token, then prompt chunks up to
the step's token budget, a long prompt's thinner while streams decode (``StallGuard``). Pure
bookkeeping over ``kv_cache.PagedKVCache``'s pool: no forward, no sampling, no threads (the
scheduler calls it under its lock), so it is unit-tested alone.

Admission is in arrival order: the head of the queue waits until the pool can hold its whole
known token list, beside what running sequences still need for theirs and a small watermark,
rather than being overtaken by smaller requests.
Blocks are then allocated step by step, as vLLM does, so a pool can run dry mid-generation: the
most recently admitted sequence is preempted (its blocks released, their full part staying in
the prefix cache), goes back to the head of the queue, and is recomputed from its tokens when
it is admitted again; its stream only pauses.

Two sequences whose prompts share a prefix that neither has computed yet (32 sessions starting
together over one system prompt) would each compute it; instead a block's hash is claimed by the
first sequence that computes it, and a sequence whose next block is claimed waits a step and
then takes the block from the cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from services.worker.block_pool import NoFreeBlocks, chain_hashes
from services.worker.kv_cache import PagedKVCache
from services.worker.sequence import SequenceState

__all__ = ["MIN_PREFILL_SHARE", "Planner", "StallGuard"]

# Prompt tokens a step computes even when decoding sequences fill its budget (at most a quarter
# of the budget): a long prompt arriving beside hundreds of streams still makes progress.
MIN_PREFILL_SHARE = 8


class StallGuard:
    """How many rows of a long prompt a step may add beside decoding streams, from measured
    step times.

    A CPU forward costs about the same per token row whether the row decodes or reads a prompt
    (the GEMMs are compute-bound beyond a few rows), so a 256-row prompt chunk made each stream
    beside it wait ~40 decode steps' worth for its next token. As Sarathi-Serve's stall-free
    batching does, a step that mixes prompt rows into decoding is kept within ``factor`` times a
    decode-only step: the prompt rows are what the measured cost per row buys in the rest. Step
    times are exponential averages, so the limit follows the batch and the context as they
    grow; until both are measured, and with ``factor`` 0, the token budget alone decides.

    Only a prompt with more left than one step's budget is spread: it would stall the streams
    step after step. One that fits (an agent's next turn, a few hundred new tokens past its
    cached prefix) is read in one step, which delays each stream's next token once, and is worth
    that for its own first token.
    """

    ALPHA = 0.3  # weight of the newest step in the averages

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.decode_s: float | None = None  # a step without prompt rows
        self.row_s: float | None = None  # one prompt row's share of a step

    def observe(self, seconds: float, decode_rows: int, prompt_rows: int) -> None:
        """Learn from a step that took ``seconds``."""
        if prompt_rows == 0:
            self.decode_s = self._mix(self.decode_s, seconds)
        elif decode_rows == 0 or self.decode_s is not None:
            base = self.decode_s if decode_rows and self.decode_s is not None else 0.0
            self.row_s = self._mix(self.row_s, max(seconds - base, 0.0) / prompt_rows)

    def prompt_rows(self, room: int) -> int:
        """Prompt rows for a step that also decodes: at most ``room``."""
        if not self.factor or self.decode_s is None or not self.row_s:
            return room
        return min(room, int((self.factor - 1) * self.decode_s / self.row_s))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)


class Planner:
    """Admission, block tables and step plans for one paged cache."""

    def __init__(
        self,
        cache: PagedKVCache,
        *,
        max_batch: int,
        max_batched_tokens: int,
        root: bytes,
        stall: float = 0.0,
    ) -> None:
        self.cache, self.pool, self.size = cache, cache.pool, cache.block_size
        self.max_batch, self.max_batched_tokens, self.root = max_batch, max_batched_tokens, root
        self.pending: deque[SequenceState] = deque()
        self.active: list[SequenceState] = []  # admission order
        self._running: set[SequenceState] = set()
        self._claims: dict[bytes, SequenceState] = {}  # full blocks being computed, by hash
        self.watermark = max(1, self.pool.num_blocks // 100)  # left free at admission
        self.guard = StallGuard(stall)
        self.preemptions = 0
        self.on_preempt: Callable[[SequenceState], None] | None = None

    # -- admission ----------------------------------------------------------------------------

    def admit(self) -> list[SequenceState]:
        """Move queued sequences into the running set while the pool holds them; return them."""
        admitted: list[SequenceState] = []
        # blocks the running sequences still need for the tokens they know (prompts they are
        # part way through): allocated step by step, but already spoken for
        promised = sum(-(-len(s.tokens) // self.size) - len(s.blocks) for s in self.active)
        while self.pending and len(self.active) < self.max_batch:
            seq = self.pending[0]
            if not seq.tokens:
                seq.tokens = [*seq.prompt, *seq.resume]
            chain_hashes(seq.tokens, len(seq.tokens), self.size, seq.hashes, self.root)
            hits = self._hits(seq, 0)
            reviving = sum(1 for b in hits if self.pool.refs[b] == 0)  # they leave the LRU
            needed = -(-len(seq.tokens) // self.size) - len(hits)
            room = self.pool.free - promised - reviving
            if needed > room - (self.watermark if self.active else 0):
                break
            promised += needed
            self.pending.popleft()
            for block in hits:
                self.pool.take(block)
            seq.blocks = hits
            seq.kv_len = len(hits) * self.size
            seq.registered = len(hits)
            if not seq.preempted:  # what the usage reports: the first admission's hits
                seq.cached = min(seq.kv_len, len(seq.prompt))
            self.active.append(seq)
            self._running.add(seq)
            admitted.append(seq)
        return admitted

    def _hits(self, seq: SequenceState, start: int) -> list[int]:
        """Cached blocks continuing ``seq``'s table from block ``start``. At least the last known
        token is always computed: its logits choose the next one."""
        limit = (len(seq.tokens) - 1) // self.size
        return self.pool.match(seq.hashes[start:limit])

    # -- a step -------------------------------------------------------------------------------

    def plan(self) -> list[tuple[SequenceState, int]]:
        """Each running sequence's new tokens this step, blocks allocated for them: one per
        decoding sequence, then prompt chunks in admission order within the token budget."""
        rows: list[tuple[SequenceState, int]] = []
        for seq in [s for s in self.active if s.to_compute == 1]:
            if seq in self._running and self._grow(seq, seq.kv_len + 1):
                rows.append((seq, 1))
        floor = max(1, min(MIN_PREFILL_SHARE, self.max_batched_tokens // 4))
        budget = max(self.max_batched_tokens - len(rows), floor)
        # streams decode in this step: a prompt too long for one step is spread thin (else it
        # would stall them step after step); one that fits is read at once, a single late token
        spread = max(self.guard.prompt_rows(budget), floor) if rows else budget
        for seq in [s for s in self.active if s.to_compute > 1]:
            if budget <= 0:
                break
            if seq not in self._running:
                continue
            self._extend(seq)
            nxt = seq.kv_len // self.size
            owner = self._claims.get(seq.hashes[nxt]) if nxt < len(seq.hashes) else None
            if owner is not None and owner is not seq and owner in self._running:
                continue  # another sequence is computing this very block: take it next step
            long = seq.to_compute > self.max_batched_tokens
            count = min(seq.to_compute, spread if long else budget)
            if count <= 0:
                continue
            if not self._grow(seq, seq.kv_len + count):
                continue
            for j in range(nxt, min(len(seq.hashes), -(-(seq.kv_len + count) // self.size))):
                self._claims.setdefault(seq.hashes[j], seq)
            rows.append((seq, count))
            budget, spread = budget - count, spread - count
        return [(s, n) for s, n in rows if s in self._running]  # a later one may have preempted

    def _extend(self, seq: SequenceState) -> None:
        """Take cached blocks that continue a prefilling sequence at a block boundary (another
        sequence finished computing them since it was admitted)."""
        if seq.kv_len % self.size or seq.kv_len // self.size != len(seq.blocks):
            return
        hits = self._hits(seq, len(seq.blocks))
        if not hits:
            return
        for block in hits:
            self.pool.take(block)
        seq.blocks.extend(hits)
        seq.cached += min(len(hits) * self.size, max(0, len(seq.prompt) - seq.kv_len))
        seq.kv_len += len(hits) * self.size
        seq.registered = len(seq.blocks)

    def _grow(self, seq: SequenceState, length: int) -> bool:
        """Blocks for ``length`` tokens in ``seq``'s table, preempting the latest admitted
        sequences while the pool is dry; False when ``seq`` was the one preempted."""
        while len(seq.blocks) * self.size < length:
            try:
                self.cache.extend(seq.blocks)
            except NoFreeBlocks:
                victim = self.active[-1]
                self.preempt(victim)
                if victim is seq:
                    return False
        return True

    def commit(self, seq: SequenceState, count: int) -> None:
        """``count`` new tokens of ``seq`` now have keys and values: blocks they filled become
        known to the prefix cache (generated tokens too, for the next turn of a conversation)."""
        seq.kv_len += count
        full = seq.kv_len // self.size
        chain_hashes(seq.tokens, seq.kv_len, self.size, seq.hashes, self.root)
        for j in range(seq.registered, full):
            self.pool.register(seq.blocks[j], seq.hashes[j])
            if self._claims.get(seq.hashes[j]) is seq:
                del self._claims[seq.hashes[j]]
        seq.registered = max(seq.registered, full)

    # -- ending -------------------------------------------------------------------------------

    def release(self, seq: SequenceState) -> None:
        """Give back ``seq``'s blocks (full ones stay cached) and forget it."""
        if seq in self._running:
            self._running.discard(seq)
            self.active.remove(seq)
        for h in seq.hashes[seq.registered :]:
            if self._claims.get(h) is seq:
                del self._claims[h]
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.kv_len = seq.registered = 0

    def preempt(self, seq: SequenceState) -> None:
        """Take ``seq``'s blocks back and queue it first, to be recomputed from its tokens."""
        self.release(seq)
        seq.preempted += 1
        self.preemptions += 1
        self.pending.appendleft(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq)
