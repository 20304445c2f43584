"""Speculative decoding on the real default model (SmolLM2-135M Q4_1 on the CPU kernels): with
``SLUICE_SPECULATIVE`` on (the default), greedy output is the same tokens as with it off, for
the benchmark's workloads (a code edit that copies most of its prompt, a story that copies
little), alone and four at once, and under a JSON schema. Nothing here is timed:
``ops/bench/speculative.py`` measures speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from ops.bench.speculative import from_prompt, job, prompts
from services.worker.speculation import Speculator
from services.worker.torch_backend import TorchBackend
from shared.config import Settings
from shared.jobs import Constraint, GenerateRequest, Message, SamplingParams, TextPart
from tests.invariants import generated_token_ids
from tests.job_factory import run

pytestmark = pytest.mark.slow

# the benchmark's own prompts: its code edit's file is frozen (ops/bench/workloads) so that the
# model's answer stays a copy of it
PROMPTS = {k: v for k, v in prompts().items() if k in ("code_edit", "story")}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded() -> tuple[TorchBackend, TorchBackend]:
    """A speculating backend (as the default settings build it) and a plain one over the same
    loaded model."""
    torch.set_num_threads(2)
    spec = TorchBackend.load(Settings(device="cpu", max_batch=4), "smollm2", None)
    assert isinstance(spec.scheduler.speculator, Speculator)
    return TorchBackend(spec.loaded, max_batch=4), spec


@pytest.fixture
async def pair(
    loaded: tuple[TorchBackend, TorchBackend],
) -> AsyncIterator[tuple[TorchBackend, TorchBackend]]:
    for b in loaded:
        await b.start()
    try:
        yield loaded
    finally:
        for b in loaded:
            await b.stop()


def request(rid: str, text: str, tokens: int, **fields: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="smollm2",
        messages=[Message(role="user", content=[TextPart(text=text)])],
        sampling=SamplingParams(temperature=0.0),
        max_tokens=tokens,
        **fields,  # type: ignore[arg-type]
    )


async def tokens(b: TorchBackend, requests: list[GenerateRequest]) -> list[list[int]]:
    return [generated_token_ids(e) for e in await asyncio.gather(*(run(b, r) for r in requests))]


@pytest.mark.parametrize("workload", list(PROMPTS))
async def test_speculation_on_writes_the_tokens_it_writes_off(
    pair: tuple[TorchBackend, TorchBackend], workload: str
) -> None:
    plain, spec = pair
    stats = spec.scheduler.speculator.stats  # type: ignore[union-attr]
    before = stats.accepted_tokens
    alone = [request(f"{workload}-1", PROMPTS[workload], 128)]
    four = [request(f"{workload}-4-{i}", f"({i}) {PROMPTS[workload]}", 64) for i in range(4)]
    outputs = []
    for requests in (alone, four):
        outputs.append(await tokens(spec, requests))
        assert outputs[-1] == await tokens(plain, requests)
    if workload == "code_edit":
        assert stats.accepted_tokens - before > 32  # drafts wrote a good part of the copy
        # The benchmark's code edit must stay what it claims to be, a copy (its answer's 4-grams
        # found in its prompt: 0.8 here); this greedy text is the same on the AVX2 and AVX-512
        # builds. Below 0.5 the model writes something else (it once repeated one sentence),
        # and ops/bench/speculative.py's code-edit rows would measure that instead.
        copied = from_prompt([[job(spec, PROMPTS[workload], 0, 128)]], outputs[0])
        assert copied > 0.5, f"the code edit's answer is no longer a copy ({copied})"


async def test_a_json_answer_is_the_same_with_speculation(
    pair: tuple[TorchBackend, TorchBackend],
) -> None:
    plain, spec = pair
    constraint = Constraint(kind="json_schema", json_schema=POINT)
    ask = "Give the point (3, 4) as JSON, then the point (3, 4) again in the same JSON form."
    requests = [request(f"json-{i}", ask, 48, constraint=constraint) for i in range(2)]
    assert await tokens(spec, requests) == await tokens(plain, requests)
