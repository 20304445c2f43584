"""``Constrainer`` masks against llguidance's own verdict, token by token, on CPU.

For every token of the tiny vocabulary, the masked logits are finite exactly where the matcher
would accept that token; free rows in the same batch are untouched; ids past the tokenizer (a
padded head) are never allowed; the reasoning open marker is allowed only where an answer may
still begin with it. The CUDA twin is ``tests/gpu/test_constrain_gpu.py``.
"""

from __future__ import annotations

import torch

from services.worker.constrain import Constrainer, ConstraintState
from shared.grammar import constraint_grammar
from shared.jobs import Constraint
from shared.model_card import ReasoningMarkers
from tests.worker_models import tiny_tokenizer

TK = tiny_tokenizer()
V = TK.get_vocab_size()
THINK = ReasoningMarkers(
    open="<think>",
    close="</think>",
    open_id=TK.token_to_id("<think>"),
    close_id=TK.token_to_id("</think>"),
)
CHOICE = constraint_grammar(Constraint(kind="choice", choices=["Paris", "Pa ris!", "Oslo"]))


def constrainer(vocab: int = V) -> Constrainer:
    return Constrainer(TK.to_str(), vocab=vocab, eos_ids=[2], max_batch=4)


def state(c: Constrainer, *, may_open: bool = False) -> ConstraintState:
    return ConstraintState(
        matcher=c._matcher(CHOICE), reasoning=THINK, inside=False, may_open=may_open
    )


def accepted(s: ConstraintState, vocab: int) -> set[int]:
    return {t for t in range(vocab) if s.matcher.deep_copy().try_consume_tokens([t]) == 1}


def test_masks_match_the_matcher_and_leave_free_rows_alone() -> None:
    c = constrainer()
    a, b = state(c), state(c)
    a.feed(TK.encode("P", add_special_tokens=False).ids[0])  # mid-answer: a narrower mask
    logits = torch.randn(3, V)
    before = logits.clone()
    pending = c.begin([a, None, b])
    assert pending is not None
    out = c.apply(logits, pending)
    for row, s in ((0, a), (2, b)):
        allowed = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert allowed == accepted(s, V) and allowed
        kept = torch.isfinite(out[row])
        assert torch.equal(out[row][kept], before[row][kept])
    assert torch.equal(out[1], before[1])


def test_padded_head_ids_are_never_allowed() -> None:
    c = constrainer(vocab=V + 40)
    s = state(c)
    pending = c.begin([s])
    assert pending is not None
    out = c.apply(torch.zeros(1, V + 40), pending)
    assert not torch.isfinite(out[0, V:]).any()
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == accepted(s, V)


def test_reasoning_marker_only_where_an_answer_may_open_with_it() -> None:
    c = constrainer()
    free_to_think, told_not_to = state(c, may_open=True), state(c)
    pending = c.begin([free_to_think, told_not_to])
    assert pending is not None
    out = c.apply(torch.zeros(2, V), pending)
    assert torch.isfinite(out[0, THINK.open_id]) and not torch.isfinite(out[1, THINK.open_id])
    free_to_think.feed(THINK.open_id)  # inside the block: the matcher waits, nothing is masked
    assert not free_to_think.active and c.begin([free_to_think]) is None
    free_to_think.feed(THINK.close_id)
    assert free_to_think.active and free_to_think.open_allowed() is None
    for token in TK.encode("Oslo", add_special_tokens=False).ids:
        free_to_think.feed(token)
    assert free_to_think.complete and not free_to_think.broken


def test_the_torch_path_cuda_takes_equals_the_numpy_path() -> None:
    """bf16 logits take the shift-and-mask path that CUDA tensors take; same verdicts."""
    c = constrainer()
    logits = torch.randn(3, V)
    via_numpy = c.apply(logits.clone(), c.begin([state(c), None, state(c)]))  # type: ignore[arg-type]
    via_torch = c.apply(logits.bfloat16(), c.begin([state(c), None, state(c)]))  # type: ignore[arg-type]
    assert torch.equal(torch.isfinite(via_torch), torch.isfinite(via_numpy))
    only_first = c.apply(logits.bfloat16(), c.begin([state(c), None, None]))  # type: ignore[arg-type]
    assert torch.isfinite(only_first[1:]).all()


def ids(text: str) -> list[int]:
    return list(TK.encode(text, add_special_tokens=False).ids)


def test_draft_rows_are_masked_as_if_the_draft_were_chosen_and_the_matcher_rolls_back() -> None:
    """Speculative decoding: a sequence with a draft owns 1 + len(draft) rows; row j + 1's mask
    is the one a matcher that consumed the draft's first j + 1 tokens gives, and the matcher is
    where it was afterwards."""
    c = constrainer()
    drafted, plain = state(c), state(c)
    draft = ids("Pa ris")[:3]
    assert drafted.admits(draft) == len(draft)
    logits = torch.randn(2 + len(draft), V)  # the drafted sequence's rows, then a free one
    pending = c.begin([drafted, None], [draft, []])
    assert pending is not None
    out = c.apply(logits.clone(), pending)
    assert torch.equal(out[-1], logits[-1])  # the free sequence's row
    walk = state(c)
    for j in range(len(draft) + 1):
        allowed = set(torch.isfinite(out[j]).nonzero().flatten().tolist())
        assert allowed == accepted(walk, V) and allowed, j
        if j < len(draft):
            walk.feed(draft[j])
    # rolled back: the drafted sequence's matcher accepts what a fresh one does
    assert accepted(drafted, V) == accepted(plain, V)
    pending = c.begin([drafted, plain], [[], draft])  # drafts beside undrafted rows
    assert pending is not None and pending.result()[0] == list(range(2 + len(draft)))


def test_a_draft_is_checked_only_where_each_token_goes_to_the_matcher() -> None:
    c = constrainer()
    answer, free_to_think = state(c), state(c, may_open=True)
    assert answer.admits([*ids("Osl"), *ids("x")]) == len(ids("Osl"))  # "Oslx" is no choice
    assert free_to_think.admits(ids("Oslo")) == 0  # its first token may open a reasoning block
    free_to_think.feed(THINK.open_id)  # inside: free up to the close marker
    thought = ids("any text")
    assert free_to_think.admits([*thought, THINK.close_id, *ids("Oslo")]) == len(thought)
    answer.feed(ids("x")[0])  # the grammar refused it: the rest of the answer is free
    assert answer.broken and answer.admits(ids("x y z")) == len(ids("x y z"))
