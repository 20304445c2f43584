"""Prompt-lookup speculation is token-exact on the CPU kernels: a backend verifying drafts
(``speculative_tokens``) writes what one without writes, token for token and logprob for
logprob, through the real scheduler thread, paged cache and prefix cache of tiny random models.

Each architecture the kernels run (Llama, Qwen2, Qwen3, Mistral) runs a prompt that repeats
itself, so drafts are proposed, accepted and (Qwen3's model) rejected too, and then every
condition of ``tests/determinism.check_invariance`` (prefix-cache hits, a batch of 16, chunked
prefill, preemption, a failover's continuation). Stops, ``max_tokens`` reached inside an
accepted draft and a seeded draw are compared too, and afterwards no block is held and the
prefix cache knows only blocks of tokens actually written. Unseeded draws have no token to
compare with, so their frequencies are: sampled with and without speculation, they pass a
chi-square test of homogeneity that a change of temperature fails.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
import torch

from services.worker import kernels
from services.worker.block_pool import chain_hashes
from services.worker.loaders import load_model
from services.worker.models.kernel_llama import QuantizedLlama
from services.worker.speculation import SpecStats, Speculator
from services.worker.step_cost import Price, StepCost
from services.worker.torch_backend import TorchBackend
from shared.events import AnyEvent, Finish, TextDelta
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart
from tests.determinism import check_invariance, greedy
from tests.invariants import check_stream, generated_token_ids
from tests.worker_models import gen, write_hf_model

torch.set_num_threads(2)

VOCAB = 384  # tiny_tokenizer's
# (arch, seed): Llama's model repeats one token (every draft accepted); Qwen3's writes varied
# text on which about half the drafted tokens are rejected
MODELS = [("LlamaForCausalLM", 5), ("Qwen3ForCausalLM", 0)]
# the other two architectures the kernels run (Qwen2: biased q/k/v; Mistral: Llama's layout
# under its own name), for the greedy comparison
MORE_MODELS = [("Qwen2ForCausalLM", 0), ("MistralForCausalLM", 0)]


def _prompts() -> tuple[list[int], list[int]]:
    ids = torch.randint(3, VOCAB, (60,), generator=gen(7)).tolist()
    return ids, ids[:20] * 4  # the second repeats itself: drafts from the start


async def backends(
    tmp_path: Path, arch: str, seed: int, dtype: str
) -> AsyncIterator[tuple[TorchBackend, TorchBackend]]:
    """A plain and a speculating backend over one tiny model (``dtype`` as ``load_model``'s)."""
    write_hf_model(tmp_path / "tiny", arch, seed=seed)
    loaded = load_model(str(tmp_path / "tiny"), dtype=dtype)
    plain = TorchBackend(loaded, max_batch=16)
    spec = TorchBackend(loaded, max_batch=16, speculative_tokens=4)
    verify_every_draft(_speculator(spec))
    await plain.start()
    await spec.start()
    try:
        yield plain, spec
    finally:
        await spec.stop()
        await plain.stop()


@pytest.fixture
async def pair(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[TorchBackend, TorchBackend]]:
    """A plain and a speculating backend over one tiny model on the kernels."""
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("the CPU kernels run only vectorized builds in the engine")
    arch, seed = request.param
    async for both in backends(tmp_path, arch, seed, "int4"):
        assert isinstance(both[0].scheduler.model, QuantizedLlama)
        yield both


class FreeRows(StepCost):
    """A step cost that says draft rows cost nothing beside a step, whatever is measured."""

    def price(self, rows: int) -> Price:
        return Price(1.0, ((0, 0.0), (1, 1e-6)))

    def refresh(self, rows: int) -> bool:
        return False  # nothing to measure


def verify_every_draft(speculator: Speculator) -> None:
    """Rows as good as free, and no floor on a row's chance: every draft the index offers is
    verified (save rests after misses), so verification runs as often as it can;
    test_draft_pacing has the real bar."""
    speculator.pacer.cost = FreeRows()
    speculator.pacer.MIN_CHANCE = 0.0


def _speculator(b: TorchBackend) -> Speculator:
    assert b.scheduler.speculator is not None
    return b.scheduler.speculator


def _stats(b: TorchBackend) -> SpecStats:
    return _speculator(b).stats


def _no_leaks(b: TorchBackend, written: list[list[int]]) -> None:
    """Nothing held once every request ended, and each cached block's hash is that of a block
    of one of the ``written`` token lists (prompt + output): no rejected draft got cached."""
    planner = b.scheduler.planner
    assert b.scheduler.cache.pool.used == 0 and not planner.active
    known: set[bytes] = set()
    for tokens in written:
        hashes: list[bytes] = []
        chain_hashes(tokens, len(tokens), planner.size, hashes, planner.root)
        known.update(hashes)
    assert set(b.scheduler.cache.pool.by_hash) <= known


@pytest.mark.parametrize("pair", MODELS + MORE_MODELS, indirect=True)
async def test_speculative_greedy_output_is_the_plain_output(
    pair: tuple[TorchBackend, TorchBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, spec = pair
    ids, repeating = _prompts()
    for prompt in (ids, repeating):
        want = await greedy(plain, prompt, 24)
        spec.scheduler.clear_prefix_cache()
        got = await greedy(spec, prompt, 24)
        assert got == want
        _no_leaks(spec, [[*prompt, *got.tokens]])
    stats = _stats(spec)
    assert stats.accepted_tokens > 0 and stats.drafts > 0
    assert stats.accepted_tokens <= stats.draft_tokens
    # every condition of the determinism suite, speculating throughout
    await check_invariance(spec, repeating, VOCAB, 24, monkeypatch)
    assert (await greedy(spec, repeating, 24)) == (await greedy(plain, repeating, 24))


@pytest.mark.parametrize("pair", [MODELS[1]], indirect=True)
async def test_drafts_are_rejected_and_the_output_still_matches(
    pair: tuple[TorchBackend, TorchBackend],
) -> None:
    plain, spec = pair
    _, repeating = _prompts()
    planner, oversized = spec.scheduler.planner, []

    def check_blocks(seconds: float, sequences: int) -> None:
        # after a step, a sequence holds blocks for the tokens it knows and no more: those a
        # rejected draft borrowed went back to the pool
        for seq in planner.active:
            if len(seq.blocks) > -(-len(seq.tokens) // planner.size):
                oversized.append((len(seq.tokens), len(seq.blocks)))

    spec.scheduler.on_step = check_blocks
    assert (await greedy(spec, repeating, 40)) == (await greedy(plain, repeating, 40))
    stats = _stats(spec)
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # both outcomes were exercised
    assert not oversized


def _job(ids: list[int], rid: str, **fields: object) -> Job:
    request = GenerateRequest(
        request_id=rid,
        model="m",
        messages=[Message(role="user", content=[TextPart(text="-")])],
        **{"ignore_eos": True, **fields},  # type: ignore[arg-type]
    )
    return Job.of(request, prompt_token_ids=ids, prompt_text="")


async def _run(b: TorchBackend, job: Job) -> tuple[list[int], str, str | None]:
    events: list[AnyEvent] = []
    async for batch in b.generate(job, [], 1):
        events.extend(batch)
    check_stream(events)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    reason = next((e.reason for e in events if isinstance(e, Finish)), None)
    return generated_token_ids(events), text, reason


@pytest.mark.parametrize("pair", [MODELS[1]], indirect=True)
async def test_stops_limits_and_draws_match(pair: tuple[TorchBackend, TorchBackend]) -> None:
    plain, spec = pair
    _, repeating = _prompts()
    greedy0 = SamplingParams(temperature=0.0)
    full = await _run(plain, _job(repeating, "full", sampling=greedy0, max_tokens=40))
    assert len(full[1]) > 12
    # its text loops from about the 25th token on, where drafts start being accepted: a stop
    # string longer than the loop first ends inside it, and so do these limits
    loop: dict[str, object] = {"sampling": greedy0, "max_tokens": 40, "stop": [full[1][-16:-2]]}
    limits: list[dict[str, object]] = [
        {"sampling": greedy0, "max_tokens": n} for n in (1, 2, 26, 31, 32, 33, 35, 38)
    ]
    cases: list[dict[str, object]] = [
        loop,
        *limits,
        {"sampling": SamplingParams(temperature=0.9, seed=1234), "max_tokens": 40},
        {"sampling": SamplingParams(temperature=0.0, logprobs=True), "max_tokens": 40},
        {"sampling": greedy0, "max_tokens": 40, "ignore_eos": False},  # EOS may end it
        {"sampling": greedy0, "max_tokens": 40, "min_tokens": 30, "ignore_eos": False},
        {"sampling": SamplingParams(temperature=0.0, repetition_penalty=1.3), "max_tokens": 40},
    ]
    for i, fields in enumerate(cases):
        before = _stats(spec).accepted_tokens
        want = await _run(plain, _job(repeating, f"p{i}", **fields))
        got = await _run(spec, _job(repeating, f"s{i}", **fields))
        assert got == want, fields
        if fields is loop:
            assert want[2] == "stop_sequence" and _stats(spec).accepted_tokens > before
    assert spec.scheduler.cache.pool.used == 0


@pytest.mark.parametrize("pair", [MODELS[1]], indirect=True)
async def test_metrics_count_drafts_and_accepted_tokens(
    pair: tuple[TorchBackend, TorchBackend],
) -> None:
    from prometheus_client import generate_latest

    from services.worker.metrics import WorkerMetrics
    from tests.metrics_text import sample

    _, spec = pair
    metrics = WorkerMetrics()
    metrics.bind(
        model="tiny", wid="w", device="cpu", version="t", running=lambda: 0.0,
        engine=spec.scheduler,
    )  # fmt: skip
    await greedy(spec, _prompts()[1], 40)
    stats = _stats(spec)
    want = {
        "drafts": stats.drafts,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
    }

    def counted() -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        return {n: sample(text, f"sluice_spec_decode_num_{n}_total", model="tiny") for n in want}

    # the stream ends before its last step's on_step hook runs: wait for that hook (bounded)
    for _ in range(500):
        if counted() == want:
            break
        await asyncio.sleep(0.01)
    assert stats.accepted_tokens > 0
    assert counted() == want


@pytest.mark.parametrize("pair", [MODELS[1]], indirect=True)
async def test_a_request_that_opts_out_never_speculates(
    pair: tuple[TorchBackend, TorchBackend],
) -> None:
    """``speculative: false`` on the job (the wire formats' extension field): no draft for it,
    the same tokens; the same prompt without the field drafts at once."""
    plain, spec = pair
    _, repeating = _prompts()
    greedy0 = SamplingParams(temperature=0.0)
    want = await _run(plain, _job(repeating, "plain", sampling=greedy0, max_tokens=24))
    before = _stats(spec).drafts
    got = await _run(
        spec, _job(repeating, "off", sampling=greedy0, max_tokens=24, speculative=False)
    )
    assert got == want and _stats(spec).drafts == before
    spec.scheduler.clear_prefix_cache()
    again = await _run(spec, _job(repeating, "on", sampling=greedy0, max_tokens=24))
    assert again == want and _stats(spec).drafts > before


def _homogeneity(a: Counter[int], b: Counter[int]) -> float:
    """Pearson's chi-square test that two samples of tokens come from one distribution: its
    p-value. Tokens expected fewer than 5 times in the smaller sample are pooled into one
    category, so the statistic's chi-square approximation holds."""
    na, nb = sum(a.values()), sum(b.values())
    both = a + b
    kept = [t for t in both if min(na, nb) * both[t] / (na + nb) >= 5]
    rows = [(a[t], b[t]) for t in kept]
    rest = (na - sum(x for x, _ in rows), nb - sum(y for _, y in rows))
    rows += [rest] if sum(rest) else []
    stat = 0.0
    for x, y in rows:
        for seen, size in ((x, na), (y, nb)):
            expected = size * (x + y) / (na + nb)
            stat += (seen - expected) ** 2 / expected
    df = torch.tensor((len(rows) - 1) / 2, dtype=torch.float64)
    assert df > 0, "one category: nothing to compare"
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("pair", [MODELS[1]], indirect=True)
async def test_sampled_frequencies_are_those_of_plain_sampling(
    pair: tuple[TorchBackend, TorchBackend],
) -> None:
    """Drawn tokens verify drafts without changing what is drawn: 600 requests with their own
    seeds on each backend (distinct seeds: equal ones would give equal tokens, which
    test_stops_limits_and_draws_match checks), and at every position the two samples' token
    frequencies agree (p > 0.001 per position, Bonferroni over the positions). The same test at
    the same size tells plain sampling at temperature 1.0 from 0.3 apart, so it can see a bias
    of that size. Seeds are fixed, so the outcome is too."""
    plain, spec = pair
    _, repeating = _prompts()
    n, length = 600, 6

    async def draw(b: TorchBackend, seeds: Iterable[int], temperature: float) -> list[list[int]]:
        sampling = [SamplingParams(temperature=temperature, top_k=6, seed=s) for s in seeds]
        jobs = [_job(repeating, f"d{p.seed}", sampling=p, max_tokens=length) for p in sampling]
        return [tokens for tokens, _, _ in await asyncio.gather(*(_run(b, j) for j in jobs))]

    def p_values(x: list[list[int]], y: list[list[int]]) -> list[float]:
        return [
            _homogeneity(Counter(t[j] for t in x), Counter(t[j] for t in y)) for j in range(length)
        ]

    stats = _stats(spec)
    drafted, accepted = stats.draft_tokens, stats.accepted_tokens
    without = await draw(plain, range(n), 1.0)
    with_drafts = await draw(spec, range(10_000, 10_000 + n), 1.0)
    assert 0 < stats.accepted_tokens - accepted < stats.draft_tokens - drafted  # both outcomes
    assert min(p_values(without, with_drafts)) > 0.001 / length
    cooler = await draw(plain, range(20_000, 20_000 + n), 0.3)
    assert min(p_values(without, cooler)) < 0.001 / length
