"""The planner alone: admission by blocks, step plans within the token budget, prefix hits,
blocks computed once for prompts that arrive together, and preemption order. No model: each
"forward" is a ``commit`` of the planned rows."""

from __future__ import annotations

import pytest
import torch

from services.worker.block_pool import root_hash
from services.worker.kv_cache import PagedKVCache
from services.worker.paging import Planner, StallGuard
from services.worker.sampling import SamplingConfig
from services.worker.sequence import SequenceState
from shared.jobs import Job

SIZE = 8


def planner(blocks: int, *, budget: int = 64, max_batch: int = 8) -> Planner:
    cache = PagedKVCache(
        layers=1, num_blocks=blocks, block_size=SIZE, kv_heads=1, head_dim=8,
        dtype=torch.float16, device=torch.device("cpu"), zeroed=False,
    )  # fmt: skip
    return Planner(cache, max_batch=max_batch, max_batched_tokens=budget, root=root_hash("m"))


def seq(prompt: list[int], max_new: int = 16) -> SequenceState:
    job = Job(request_id="r", model="m", prompt_token_ids=prompt, prompt_text="")
    return SequenceState(
        job=job, prompt=prompt, resume=[], attempt=1, starts_in_reasoning=False,
        sampling=SamplingConfig(), generator=None, max_new=max_new,
        emit=lambda _: None, on_freed=lambda: None,
    )  # fmt: skip


def step(p: Planner, sample: int = 7) -> list[tuple[SequenceState, int]]:
    """Admit, plan, commit; every sequence whose rows reach its last token samples ``sample``."""
    p.admit()
    rows = p.plan()
    for s, n in rows:
        p.commit(s, n)
        if s.kv_len == len(s.tokens):
            s.tokens.append(sample)
    return rows


def test_decode_rows_first_then_prompt_chunks_within_the_budget() -> None:
    p = planner(64, budget=20)
    short, long = seq(list(range(5))), seq(list(range(100, 150)))
    p.pending.extend([short, long])
    assert [(s is short, n) for s, n in step(p)] == [(True, 5), (False, 15)]
    assert [(s is short, n) for s, n in step(p)] == [(True, 1), (False, 19)]  # short decodes
    assert [n for _, n in step(p)] == [1, 16]  # the prompt's last chunk
    assert long.kv_len == 50 and len(long.tokens) == 51  # its first token was sampled
    assert [n for _, n in step(p)] == [1, 1]
    assert len(long.blocks) == 7  # 51 keys and values -> 7 blocks of 8


def test_a_long_prompt_still_progresses_beside_a_full_budget_of_decoders() -> None:
    p = planner(512, budget=4, max_batch=16)  # six decoders overrun it
    decoders = [seq([i, i + 1]) for i in range(6)]
    p.pending.extend(decoders)
    while any(len(s.tokens) < 3 for s in decoders):  # every prompt read, a token sampled
        step(p)
    prompt = seq(list(range(200, 300)))
    p.pending.append(prompt)
    rows = step(p)
    assert sum(n for s, n in rows if s is not prompt) == 6
    assert dict((id(s), n) for s, n in rows)[id(prompt)] == 1  # the floor: a quarter budget


def test_admission_is_in_order_and_counts_what_running_prompts_still_need() -> None:
    p = planner(10, max_batch=2)
    a, b, c = seq(list(range(40))), seq(list(range(50, 90))), seq([1, 2])
    p.pending.extend([a, b, c])
    assert p.admit() == [a]  # a will need 5 blocks; 10 - 5 - watermark 1 < 5 for b
    assert p.admit() == []  # c is small but waits behind b
    p.release(a)
    assert p.admit() == [b, c]


def test_prefix_hits_are_whole_blocks_and_the_last_token_is_computed() -> None:
    p = planner(32)
    first = seq(list(range(24)))
    p.pending.append(first)
    step(p)
    p.release(first)
    again = seq(list(range(24)))  # 3 full blocks cached; the last token needs its logits
    p.pending.append(again)
    p.admit()
    assert again.cached == 16 and again.kv_len == 16
    other = seq([*range(20), 99, 98, 97, 96, 95])
    p.pending.append(other)
    p.admit()
    assert other.cached == 16 and other.blocks[:2] == again.blocks[:2]  # shared, read-only


def test_generated_tokens_become_cacheable_as_their_blocks_fill() -> None:
    p = planner(32)
    s = seq(list(range(6)))
    p.pending.append(s)
    for _ in range(4):
        step(p)
    assert s.kv_len == 9 and s.registered == 1  # the first block filled with 2 generated tokens
    turn2 = seq([*s.tokens[:8], 1, 2, 3])
    p.pending.append(turn2)
    p.admit()
    assert turn2.cached == 8 and turn2.blocks[0] == s.blocks[0]


def test_streams_decoding_together_keep_their_blocks_in_runs() -> None:
    """Streams take a new block in turns; each still gets the block after its last, so the
    kernels read a sequence's keys and values front to back (not every fourth block)."""
    p = planner(128, budget=64)
    streams = [seq([100 * i + t for t in range(12)], max_new=60) for i in range(4)]
    p.pending.extend(streams)
    for _ in range(50):
        step(p)
    for s in streams:
        assert len(s.blocks) == 8  # 12 prompt tokens and 49 generated, in blocks of 8
        assert s.blocks == list(range(s.blocks[0], s.blocks[0] + 8))
    # prompts at the pool's start, then (a pool too small for BlockPool.GAP) half way along the
    # free runs with the most room
    assert sorted(s.blocks[0] for s in streams) == [0, 33, 65, 97]


def test_a_table_extended_block_by_block_is_one_run() -> None:
    cache = planner(64).cache
    a = cache.extend([], 3)
    b = cache.extend([], 3)
    for _ in range(2):  # growing in turns
        cache.extend(a)
        cache.extend(b)
    assert a == list(range(a[0], a[0] + 5)) and b == list(range(b[0], b[0] + 5))
    assert not set(a) & set(b)


def test_prompts_arriving_together_compute_a_shared_prefix_once() -> None:
    p = planner(64, budget=64)
    system = list(range(300, 340))  # 5 blocks
    a, b = seq([*system, 1, 2, 3]), seq([*system, 4, 5, 6])
    p.pending.extend([a, b])
    rows = step(p)
    assert [s for s, _ in rows] == [a]  # b's first block is being computed by a
    rows = step(p)
    assert b.cached == 40 and b.blocks[:5] == a.blocks[:5]
    assert [(s, n) for s, n in rows if s is b] == [(b, 3)]  # only its own tail


def test_a_dry_pool_preempts_the_latest_admitted_which_resumes_from_its_blocks() -> None:
    p = planner(6)  # watermark 1
    a, b = seq(list(range(16))), seq(list(range(50, 66)))
    p.pending.extend([a, b])
    step(p)  # both prompts: 2 blocks each
    assert p.active == [a, b]
    for _ in range(8):  # a and b grow into their third blocks: 6 blocks, then a needs a 4th
        step(p)
    assert len(a.tokens) > 24 and p.preemptions == 0
    while p.preemptions == 0:
        step(p)
    assert p.active == [a] and list(p.pending) == [b] and b.blocks == []
    tokens = list(b.tokens)
    p.release(a)
    p.admit()
    # b had filled three blocks; a took the tail one (evicted first), its prefix stayed cached
    assert len(tokens) == 25 and b.kv_len == 16
    assert b.tokens == tokens and b.cached == 0  # usage keeps the first admission's hits


def test_the_stall_guard_buys_prompt_rows_with_what_a_decode_step_costs() -> None:
    guard = StallGuard(2.5)
    assert guard.prompt_rows(200) == 200  # nothing measured yet: the budget decides
    guard.observe(0.5, 0, 100)  # a prompt-only step: 5 ms a row
    guard.observe(0.02, 8, 0)  # eight streams decoding: 20 ms a step
    assert guard.prompt_rows(200) == 6  # 1.5 x 20 ms buys six 5 ms rows
    guard.observe(0.05, 8, 6)  # a mixed step: 30 ms for 6 rows beside the decode
    assert guard.row_s == pytest.approx(0.005)  # (50 - 20) / 6 ms: the same cost a row
    assert guard.prompt_rows(3) == 3
    assert StallGuard(0).prompt_rows(200) == 200  # off


def test_a_step_beside_decoding_streams_reads_what_the_guard_allows() -> None:
    p = planner(512, budget=257)
    p.guard = StallGuard(2.0)
    p.guard.observe(0.4, 0, 100)  # 4 ms a prompt row
    p.guard.observe(0.036, 2, 0)  # 36 ms a decode step: nine rows
    a, b = seq([1, 2, 3]), seq([4, 5, 6])
    p.pending.extend([a, b])
    step(p)
    long, short = seq(list(range(100, 400))), seq(list(range(500, 600)))
    p.pending.extend([long, short])
    got = {id(s): n for s, n in step(p)}
    assert got[id(long)] == 9  # longer than the budget: spread
    assert got[id(short)] == 100  # fits one step: read at once
    assert {id(s): n for s, n in step(p)}[id(long)] == 9  # short decodes now: still spread
    for other in (a, b, short):
        p.release(other)
    assert step(p) == [(long, 257)]  # nothing decodes: the whole budget
