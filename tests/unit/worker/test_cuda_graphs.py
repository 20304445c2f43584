"""Decode graphs' bucket ladder and padding, without a GPU: a padded step (what a captured graph
replays) gives the real rows the logits an unpadded forward gives, and its padding rows write
only the block the graphs hold for themselves."""

from __future__ import annotations

import pytest
import torch

from services.worker.cuda_graphs import BUCKETS, DecodeGraphs, bucket_for, buckets_up_to
from services.worker.kv_cache import SeqRows, build_batch
from tests.model_runs import model_cache, rows_for
from tests.worker_models import random_model


def test_buckets_follow_the_ladder_up_to_max_batch() -> None:
    assert buckets_up_to(256) == list(BUCKETS)
    assert buckets_up_to(48) == [1, 2, 4, 8, 16, 32, 48]
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(300)[-2:] == [256, 300]


def test_a_step_takes_the_smallest_bucket_that_holds_it() -> None:
    ladder = buckets_up_to(48)
    assert [bucket_for(n, ladder) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert bucket_for(49, ladder) is None


@pytest.mark.parametrize("n", [3, 5])
def test_padded_step_equals_unpadded_forward(n: int) -> None:
    model = random_model("Qwen2ForCausalLM", 101, seed=2)
    plain, padded = model_cache(model, blocks=40), model_cache(model, blocks=40)
    graphs = DecodeGraphs(model, padded, max_batch=8, max_blocks=8)
    assert padded.pool.used == 1  # the padding block, held for good
    g = torch.Generator().manual_seed(n)
    lengths = [int(x) for x in torch.randint(1, 60, (n,), generator=g)]
    prompts = [torch.randint(3, 101, (t,), generator=g).tolist() for t in lengths]
    tables: list[list[list[int]]] = [[[] for _ in range(n)], [[] for _ in range(n)]]
    with torch.inference_mode():
        for cache, tabs in zip((plain, padded), tables, strict=True):
            spans = [rows_for(cache, tabs[i], 0, lengths[i], key=i) for i in range(n)]
            ids = torch.tensor([t for p in prompts for t in p])
            model(ids, build_batch(spans, 16, cache.device), cache)
        nxt = [int(t) for t in torch.randint(3, 101, (n,), generator=g)]
        spans = [rows_for(plain, tables[0][i], lengths[i], 1, key=i) for i in range(n)]
        want = model(torch.tensor(nxt), build_batch(spans, 16, plain.device), plain)
        spans = [rows_for(padded, tables[1][i], lengths[i], 1, key=i) for i in range(n)]
        got = graphs.run(nxt, spans)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    # every real block holds the same keys in both caches; the pad block was never handed out
    for mine, theirs in zip(tables[0], tables[1], strict=True):
        torch.testing.assert_close(padded.k[:, :, theirs], plain.k[:, :, mine])
        assert graphs.pad_block not in theirs


def test_more_rows_than_the_largest_bucket_is_refused() -> None:
    model = random_model("LlamaForCausalLM", 64, seed=1)
    cache = model_cache(model, blocks=8)
    graphs = DecodeGraphs(model, cache, max_batch=2, max_blocks=2)
    spans = [rows_for(cache, [], 0, 1, key=i) for i in range(3)]
    with pytest.raises(ValueError, match="exceed the largest captured batch"):
        graphs.run([5, 6, 7], spans)


def test_capture_needs_cuda() -> None:
    model = random_model("LlamaForCausalLM", 64, seed=1)
    graphs = DecodeGraphs(model, model_cache(model, blocks=4), max_batch=2, max_blocks=2)
    with pytest.raises(RuntimeError, match="CUDA"):
        graphs.capture()


def test_staging_keeps_each_row_equal_to_its_sequence_as_tables_change() -> None:
    # The host buffers a captured step copies to the device: each row's block table is
    # rewritten only where it changed, which must never leave a row holding another table's
    # blocks, whatever the steps do: sequences joining and leaving (rows shift), tables growing,
    # a draft's blocks given back, a preempted sequence's table rebuilt from other blocks.
    model = random_model("LlamaForCausalLM", 64, seed=1)
    cache = model_cache(model, blocks=8)
    graphs = DecodeGraphs(model, cache, max_batch=16, max_blocks=12)
    g = torch.Generator().manual_seed(7)

    def rand(hi: int) -> int:
        return int(torch.randint(0, hi, (1,), generator=g))

    tables = {k: [rand(500) for _ in range(1 + rand(6))] for k in range(10)}
    for _ in range(300):
        k = rand(12)
        match rand(5):
            case 0:  # a new sequence, or a preempted one's table rebuilt
                tables[k] = [rand(500) for _ in range(1 + rand(6))]
            case 1 if k in tables and len(tables[k]) < 12:  # one more block
                tables[k].append(rand(500))
            case 2 if k in tables and len(tables[k]) > 1:  # a rejected draft's block back
                tables[k].pop()
            case 3:
                tables.pop(k, None)
        live = sorted(tables)[: 1 + rand(len(tables))] if tables else []
        if not live:
            continue
        spans = [SeqRows(k, tables[k], 3 * k, 1) for k in live]
        b = bucket_for(len(spans), graphs.buckets)
        assert b is not None
        width = graphs.stage([k + 1 for k in live], spans, b)
        assert width == max(len(tables[k]) for k in live)
        host = graphs._tables.numpy()
        for i, k in enumerate(live):
            assert host[i, : len(tables[k])].tolist() == tables[k]
        assert graphs._positions.numpy()[: len(live)].tolist() == [3 * k for k in live]
        assert graphs._ids.numpy()[: len(live)].tolist() == [k + 1 for k in live]
        assert (host[len(live) : b, 0] == graphs.pad_block).all()
