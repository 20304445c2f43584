"""The scheduler's batched chooser (``TokenChooser.batch``, the GPU's) on CPU tensors through
the engine: the same greedy tokens and logprobs as the per-sequence chooser with each kind of
penalty, and seeded draws repeated alone or beside other requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from services.worker.loaders import load_model
from services.worker.torch_backend import TorchBackend
from shared.events import AnyEvent
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart
from tests.invariants import generated_token_ids
from tests.job_factory import run
from tests.worker_models import write_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    write_hf_model(path, "Qwen3ForCausalLM", seed=11)
    return path


@asynccontextmanager
async def _backend(tiny_dir: Path, *, batched: bool) -> AsyncIterator[TorchBackend]:
    """A started backend on the tiny model; ``batched``: its scheduler's batched chooser (the
    GPU's ``TokenChooser.batch``) on CPU tensors."""
    b = TorchBackend(load_model(str(tiny_dir)), max_batch=4)
    b.scheduler.chooser.on_device = batched
    await b.start()
    try:
        yield b
    finally:
        await b.stop()


def _job(text: str, rid: str, **kw: object) -> GenerateRequest:
    kw.setdefault("max_tokens", 12)
    return GenerateRequest(
        request_id=rid,
        model="tiny",
        messages=[Message(role="user", content=[TextPart(text=text)])],
        **kw,  # type: ignore[arg-type]
    )


def _logprobs(events: list[AnyEvent]) -> list[float]:
    return [lp.logprob for e in events for lp in getattr(e, "logprobs", None) or []]


def _looping(rid: str, presence: float = 0.0, frequency: float = 0.0, rep: float = 1.0) -> Job:
    """Greedy from a raw prompt on which the tiny model loops over four tokens: a penalty on
    generated or seen tokens breaks the loop."""
    sampling = SamplingParams(
        temperature=0.0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=rep,
    )
    request = _job("", rid, ignore_eos=True, sampling=sampling)
    return Job.of(request, prompt_token_ids=[77] * 8, prompt_text="")


GREEDY_JOBS = [
    _looping("plain"),
    _looping("repetition", rep=1.3),
    _looping("frequency", frequency=1.0),
    _looping("presence", presence=1.5),
    _looping("all", presence=0.5, frequency=0.5, rep=1.2),
    _job(
        "What is the weather",
        "logprobs",
        min_tokens=6,
        sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
    ),
]


async def test_the_batched_chooser_gives_the_per_sequence_greedy_tokens(tiny_dir: Path) -> None:
    """The same greedy requests, one at a time, through both choosers: the same tokens (and
    logprobs), with each kind of penalty alone and together."""
    tokens: dict[bool, list[list[int]]] = {}
    logprobs: dict[bool, list[float]] = {}
    for batched in (False, True):
        async with _backend(tiny_dir, batched=batched) as b:
            runs = [await run(b, j) for j in GREEDY_JOBS]
        tokens[batched] = [generated_token_ids(e) for e in runs]
        logprobs[batched] = _logprobs(runs[-1])
    assert tokens[True] == tokens[False]
    plain = tokens[True][0]
    assert plain[:4] == plain[4:8]  # the loop
    assert all(t != plain for t in tokens[True][1:5])  # each penalty was in play
    assert len(logprobs[True]) >= 6
    assert logprobs[True] == pytest.approx(logprobs[False], abs=1e-5)


def _seeded(rid: str, seed: int, text: str = "Hello world") -> GenerateRequest:
    return _job(
        text,
        rid,
        max_tokens=16,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=seed),
    )


async def test_seeded_draws_repeat_alone_and_beside_other_requests(tiny_dir: Path) -> None:
    """Seeded requests (temperature 0.8, top_p 0.9) through the batched chooser: the same tokens
    run again, and run together with a greedy, an unseeded and another seeded request."""
    seeds = [1, 2, 2**64 - 1]  # any 64-bit seed
    async with _backend(tiny_dir, batched=True) as b:
        first = [generated_token_ids(await run(b, _seeded(f"a{s}", s))) for s in seeds]
        again = [generated_token_ids(await run(b, _seeded(f"b{s}", s))) for s in seeds]
        others = [
            _job(
                "The quick brown fox",
                "greedy",
                ignore_eos=True,
                sampling=SamplingParams(temperature=0.0),
            ),
            _job("Paris weather", "unseeded", ignore_eos=True, max_tokens=20),
            _seeded("other-seed", 99, text="emoji done"),
        ]
        together = await asyncio.gather(
            *(run(b, _seeded(f"c{s}", s)) for s in seeds), *(run(b, j) for j in others)
        )
    assert first == again
    assert [generated_token_ids(e) for e in together[: len(seeds)]] == first
    assert all(len(t) == 16 for t in first)
    assert first[0] != first[1]
