"""The GPU engine: decode steps replayed from CUDA graphs, paged attention in the Triton kernel,
the batched device sampler, prefix sharing and preemption on the device. Skipped without CUDA.

Greedy tokens are compared in fp32 (cuBLAS without TF32, the kernel's products in IEEE fp32):
a graph's padded batch and an eager batch of another size multiply matrices of other shapes, and
in bf16 that moves logits by more than a random tiny model's near-ties.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.worker.kv_cache import build_batch
from services.worker.loaders import load_model
from services.worker.paged_attention import paged_attention, paged_attention_reference
from services.worker.torch_backend import TorchBackend
from shared.events import AnyEvent, Start
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart
from tests.determinism import greedy, preempt_once
from tests.invariants import check_stream, generated_token_ids
from tests.model_runs import rows_for
from tests.worker_models import ARCH_MODEL_TYPE, gen, write_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

VOCAB = 384  # tiny_tokenizer's


def backend(path: Path, *, graphs: bool = True, dtype: str = "float32", **kw: int) -> TorchBackend:
    loaded = load_model(str(path), device="cuda", dtype=dtype)
    return TorchBackend(loaded, cuda_graphs=graphs, **kw)  # type: ignore[arg-type]


def prompts(n: int, seed: int) -> list[list[int]]:
    g = gen(seed)
    return [torch.randint(3, VOCAB, (int(8 + 5 * i % 41),), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("arch", sorted(ARCH_MODEL_TYPE))
async def test_graph_tokens_equal_eager_tokens(tmp_path: Path, arch: str) -> None:
    write_hf_model(tmp_path / "m", arch, seed=11, max_position_embeddings=512)
    runs: list[list[list[int]]] = []
    for graphs in (False, True):
        b = backend(tmp_path / "m", graphs=graphs, max_batch=32)
        await b.start()
        try:
            assert (b.scheduler.graphs is not None) == graphs
            if graphs:
                assert b.scheduler.graphs is not None
                assert sorted(b.scheduler.graphs.graphs) == [1, 2, 4, 8, 16, 32]
            out = []
            for n in (1, 3, 17):
                b.scheduler.clear_prefix_cache()
                got = await asyncio.gather(
                    *(greedy(b, p, 12, rid=f"r{i}") for i, p in enumerate(prompts(n, n)))
                )
                out.extend(g.tokens for g in got)
            runs.append(out)
        finally:
            await b.stop()
    assert runs[1] == runs[0]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
async def test_graph_logits_match_eager_in_bf16(tmp_path: Path, arch: str) -> None:
    """A replayed step's logits equal the same step run eagerly (same padded shapes), and come
    close to an unpadded eager step."""
    write_hf_model(tmp_path / "m", arch, seed=12, max_position_embeddings=512)
    b = backend(tmp_path / "m", dtype="auto", max_batch=8)
    await b.start()
    try:
        graphs = b.scheduler.graphs
        assert graphs is not None and b.loaded.dtype == torch.bfloat16
        ids = prompts(3, 4)
        for i, p in enumerate(ids):  # fill three sequences' caches
            await greedy(b, p, 2, rid=f"fill{i}")
        cache = b.scheduler.cache
        tables: list[list[int]] = [[], [], []]
        with torch.inference_mode():
            spans = [rows_for(cache, tables[i], 0, len(p), key=i) for i, p in enumerate(ids)]
            flat = torch.tensor([t for p in ids for t in p], device="cuda")
            b.loaded.model(flat, build_batch(spans, 16, cache.device), cache)
            spans = [rows_for(cache, tables[i], len(p), 1, key=i) for i, p in enumerate(ids)]
            replayed = graphs.run([5, 6, 7], spans).clone()
            eager = b.loaded.model(
                torch.tensor([5, 6, 7], device="cuda"), build_batch(spans, 16, cache.device), cache
            )
        scale = eager.abs().max().item()
        assert (replayed - eager).abs().max().item() < 0.05 * scale
    finally:
        await b.stop()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_paged_kernel_equals_reference_on_ragged_batches(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    kv, group, hd, blocks, bs = 8, 4, 128, 300, 16
    k = torch.randn(kv, blocks, bs, hd, generator=g).to(dtype)
    v = torch.randn(kv, blocks, bs, hd, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[:288].view(4, 72).int()
    seq = torch.tensor([0, 1, 2, 3, 1, 0, 2])
    pos = torch.tensor([0, 15, 16, 1151, 700, 1000, 333])
    q = torch.randn(7, kv * group, hd, generator=g).to(dtype)
    want = paged_attention_reference(q, k, v, tables, seq, pos, hd**-0.5)
    for splits in (None, 1, 5):
        got = paged_attention(*(t.cuda() for t in (q, k, v, tables, seq, pos)), hd**-0.5, splits)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


def _job(ids: list[int], rid: str, tokens: int, **sampling: object) -> Job:
    request = GenerateRequest(
        request_id=rid,
        model="m",
        messages=[Message(role="user", content=[TextPart(text="-")])],
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        max_tokens=tokens,
        ignore_eos=True,
    )
    return Job.of(request, prompt_token_ids=ids, prompt_text="")


async def _events(b: TorchBackend, job: Job) -> list[AnyEvent]:
    events: list[AnyEvent] = []
    async for batch in b.generate(job, [], 1):
        events.extend(batch)
    check_stream(events)
    return events


async def test_prefix_sharing_and_preemption_keep_the_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_hf_model(tmp_path / "m", "LlamaForCausalLM", seed=13, max_position_embeddings=512)
    b = backend(tmp_path / "m", max_batch=16)
    await b.start()
    try:
        ids = torch.randint(3, VOCAB, (70,), generator=gen(9)).tolist()
        b.scheduler.clear_prefix_cache()
        alone = await greedy(b, ids, 16)
        # another request shares 3 blocks and a bit: this one reads them from the cache
        await greedy(b, [*ids[:50], 7], 1, rid="prefix")
        events = await _events(b, _job(ids, "again", 16, temperature=0.0))
        start = next(e for e in events if isinstance(e, Start))
        assert start.cached_tokens >= 48
        assert generated_token_ids(events) == alone.tokens
        for after in (1, 8):
            b.scheduler.clear_prefix_cache()
            with monkeypatch.context() as patch:
                preempt_once(patch, b.scheduler.planner, after)
                got = await greedy(b, ids, 16, rid="preempted")
                assert b.scheduler.planner.preemptions == 1
            assert got.tokens == alone.tokens, f"a preemption after {after} tokens changed them"
    finally:
        await b.stop()


async def test_seeded_sampling_on_the_device_is_reproducible(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "m", "Qwen2ForCausalLM", seed=14, max_position_embeddings=512)
    b = backend(tmp_path / "m", dtype="auto", max_batch=16)
    await b.start()
    try:
        ids = prompts(1, 2)[0]
        knobs = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 1234}
        first = generated_token_ids(await _events(b, _job(ids, "s1", 20, **knobs)))
        crowd = [_job(p, f"c{i}", 20, temperature=1.0) for i, p in enumerate(prompts(9, 5))]
        runs = await asyncio.gather(
            _events(b, _job(ids, "s2", 20, **knobs)), *(_events(b, j) for j in crowd)
        )
        assert generated_token_ids(runs[0]) == first
        other = generated_token_ids(await _events(b, _job(ids, "s3", 20, **{**knobs, "seed": 9})))
        assert other != first
    finally:
        await b.stop()


async def test_256_streams_at_once(tmp_path: Path) -> None:
    """The default GPU batch: 256 sequences decode together in the largest graph."""
    write_hf_model(tmp_path / "m", "Qwen3ForCausalLM", seed=15, max_position_embeddings=512)
    b = backend(tmp_path / "m", dtype="auto")
    assert b.max_batch == 256
    await b.start()
    try:
        graphs = b.scheduler.graphs
        assert graphs is not None and graphs.max_rows == 256
        seen: list[int] = []
        step = b.scheduler.on_step

        def count(seconds: float, rows: int) -> None:
            seen.append(rows)
            if step is not None:
                step(seconds, rows)

        b.scheduler.on_step = count
        jobs = [_job(p, f"m{i}", 24, temperature=0.0) for i, p in enumerate(prompts(256, 6))]
        runs = await asyncio.gather(*(_events(b, j) for j in jobs))
        assert all(len(generated_token_ids(e)) == 24 for e in runs)
        assert max(seen) == 256
    finally:
        await b.stop()
