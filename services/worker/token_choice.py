"""The next token of each sampled sequence of a step, and its log-probability when asked.

Two ways, one semantics: on the CPU each sequence's row is chosen alone (``sampling.py``: the
row is in host memory, and numpy's argmax costs microseconds); on a GPU the step's rows are
chosen together on the device with one copy of the ids to the host (``batch_sampling.py``).
Either way the decoder's forced token wins, penalties and EOS bans apply first, and logprobs are
read off the logits before them.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from services.worker.batch_sampling import RowChoice, choose_tokens
from services.worker.sampling import (
    apply_penalties,
    logprob_entry,
    mask_tokens,
    sample_next_token,
    token_logprob,
)
from services.worker.sequence import SequenceState
from shared.events import TokenLogprob

__all__ = ["TokenChooser"]

Choice = tuple[int, TokenLogprob | None]


class TokenChooser:
    """Chooses tokens for the scheduler; ``on_device`` picks the batched GPU way."""

    def __init__(self, eos_ids: list[int], tokenizer: Tokenizer, *, on_device: bool) -> None:
        self.eos_ids, self.tokenizer, self.on_device = eos_ids, tokenizer, on_device

    def _bans_eos(self, seq: SequenceState) -> bool:
        free = seq.constraint is None or not seq.constraint.active  # a grammar decides the end
        return free and (seq.job.ignore_eos or seq.generated < seq.job.min_tokens)

    def one(self, seq: SequenceState, logits: torch.Tensor) -> Choice:
        """``seq``'s token from its own (V,) row, on the CPU."""
        assert seq.decoder is not None
        token = seq.decoder.forced_next_token()
        if token is None:
            row = logits.float().cpu()
            cfg = seq.sampling
            if seq.counts is not None or seq.seen is not None:  # either kind alone, too
                counts = torch.zeros_like(row) if seq.counts is None else seq.counts
                seen = torch.zeros_like(row, dtype=torch.bool) if seq.seen is None else seq.seen
                row = apply_penalties(row, counts, seen, cfg)
            if self._bans_eos(seq):
                row = mask_tokens(row, [i for i in self.eos_ids if i < row.numel()])
            token = sample_next_token(row, cfg, seq.generator)
        if not seq.job.sampling.logprobs:
            return token, None
        return token, token_logprob(logits, token, seq.job.sampling.top_logprobs, self.tokenizer)

    def row(self, seq: SequenceState, logits: torch.Tensor) -> Choice:
        """``seq``'s token from one (V,) row, chosen the way this chooser chooses a step's: a
        draft's verification then draws what one-token steps would have drawn."""
        return self.batch([seq], logits[None])[0] if self.on_device else self.one(seq, logits)

    def batch(self, seqs: list[SequenceState], logits: torch.Tensor) -> list[Choice]:
        """Every sequence's token from the rows of ``logits`` (m, V), on their device."""
        rows = []
        for seq in seqs:
            assert seq.decoder is not None
            want = seq.job.sampling.logprobs
            rows.append(
                RowChoice(
                    sampling=seq.sampling,
                    seed=seq.seed,
                    counter=len(seq.tokens),
                    ban_eos=self._bans_eos(seq),
                    counts=seq.counts,
                    seen=seq.seen,
                    forced=seq.decoder.forced_next_token(),
                    logprobs=seq.job.sampling.top_logprobs if want else -1,
                )
            )
        tokens, logprobs = choose_tokens(logits.float(), rows, self.eos_ids)
        return [
            (t, None if lp is None else logprob_entry(t, lp[0], lp[1], self.tokenizer))
            for t, lp in zip(tokens, logprobs, strict=True)
        ]

    @staticmethod
    def count(seq: SequenceState, token: int) -> None:
        """Account ``token`` in ``seq``'s penalty state."""
        if seq.counts is not None:
            seq.counts[token] += 1
        if seq.seen is not None:
            seq.seen[token] = True
