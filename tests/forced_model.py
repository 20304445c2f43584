"""A forced-sequence model double: reasoning and tool paths, deterministically, through the real
engine.

* ``ForcedSequenceModel``: an ``nn.Module`` with the model interface whose logits force a scripted
  token sequence.
* ``forced_backend(script)``: the real ``TorchBackend`` over it, with the tiny tokenizer and a
  ChatML card carrying the reasoning/tool markers.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.kv_cache import AttentionBatch, PagedKVCache
from services.worker.loaders import LoadedModel, build_card
from services.worker.models.llama import LlamaConfig
from services.worker.torch_backend import TorchBackend
from tests.worker_models import CHAT_TEMPLATE, tiny_tokenizer


class ForcedSequenceModel(nn.Module):
    """A model double whose logits force ``script`` token by token, then ``end_id`` forever.

    It keeps, per sequence (``SeqRows.key``), the position it expects next; a forward at any
    other position is a new prefill, which restarts the script. Tests wrap it in a
    ``LoadedModel`` with a real tokenizer and card, so the engine, decoder, template and parsers
    are all real.
    """

    def __init__(self, script: list[int], vocab_size: int, end_id: int, context: int = 256) -> None:
        super().__init__()
        self.script, self.end_id = script, end_id
        self.config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=2,
            context_length=context,
        )
        self._next: dict[int, tuple[int, int]] = {}  # sequence -> (next position, script index)
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(
        self, idx: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """Return (m, V) logits with a single clear winner per sequence that wants logits."""
        out = torch.full((batch.logit_rows.numel(), self.config.vocab_size), -10.0)
        row = 0
        for s in batch.seqs:
            pos, k = self._next.get(s.key, (-1, 0))
            k = k if (s.count == 1 and s.start == pos) else 0
            self._next[s.key] = (s.start + s.count, k + 1 if s.logits else k)
            if s.logits:
                out[row, self.script[k] if k < len(self.script) else self.end_id] = 10.0
                row += 1
        return out


def forced_backend(script: str, *, context: int = 256, max_batch: int = 2) -> TorchBackend:
    """The real engine over ``ForcedSequenceModel`` writing ``script``, with the tiny tokenizer.

    The card has the ChatML template and the tokenizer's reasoning/tool markers, so everything
    but the choice of tokens (decoder, router, tool parser, stop matcher, scheduler) is real.
    """
    tk = tiny_tokenizer()
    card = build_card(
        name="forced",
        architecture="forced",
        context_length=context,
        tokenizer=tk,
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token="<|im_end|>",
        eos_token_ids=[2],
        add_bos_token=False,
        source="test",
    )
    model = ForcedSequenceModel(
        tk.encode(script).ids, tk.get_vocab_size(), end_id=2, context=context
    )
    loaded = LoadedModel(
        model=model,  # type: ignore[arg-type]  # a double with the model interface
        tokenizer=tk,
        card=card,
        device=torch.device("cpu"),
        dtype=torch.float32,
        load_seconds=0.0,
    )
    return TorchBackend(loaded, max_batch=max_batch)
