"""Speculative decoding under a grammar is token-exact on the CPU kernels: drafts are cut to
what the grammar allows, their rows masked as one-token steps would mask them, and the output of
a speculating backend equals the plain one's, greedy and seeded, alone and beside free streams,
and where the model may open a reasoning block first (Qwen3's model does, and stays in it).
"""

from __future__ import annotations

import asyncio

import pytest

from services.worker.constrain import ConstraintState
from services.worker.torch_backend import TorchBackend
from shared.jobs import Constraint, ReasoningControl, SamplingParams, ToolChoice
from tests.unit.worker.test_constrained import WEATHER
from tests.unit.worker.test_speculation import MODELS, _job, _prompts, _run, _stats, pair

__all__ = ["pair"]  # the fixture, shared with test_speculation

CONSTRAINTS = [
    Constraint(kind="regex", regex="(ab[cd] ){12}"),  # repeats, with a choice each time
    Constraint(
        kind="json_schema",
        json_schema={
            "type": "array",
            "items": {"enum": ["alpha beta", "alpha gamma", "delta"]},
            "minItems": 6,
            "maxItems": 6,
        },
    ),
    Constraint(kind="choice", choices=["one two one two one two", "one two three four"]),
]
SAMPLING = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7)]
NO_THINKING = ReasoningControl(effort="none")  # the answer, and the grammar, from the start
GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("pair", MODELS, indirect=True)
async def test_constrained_output_is_the_plain_output(
    pair: tuple[TorchBackend, TorchBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, spec = pair
    _, repeating = _prompts()
    checked: list[tuple[int, int]] = []  # (draft length, tokens the grammar allowed)
    admits = ConstraintState.admits

    def recording(self: ConstraintState, draft: list[int]) -> int:
        allowed = admits(self, draft)
        checked.append((len(draft), allowed))
        return allowed

    monkeypatch.setattr(ConstraintState, "admits", recording)
    before = _stats(spec).accepted_tokens
    for i, constraint in enumerate(CONSTRAINTS):
        for sampling in SAMPLING:
            fields = {"constraint": constraint, "sampling": sampling, "max_tokens": 160}
            want = await _run(plain, _job(repeating, f"p{i}", reasoning=NO_THINKING, **fields))
            got = await _run(spec, _job(repeating, f"s{i}", reasoning=NO_THINKING, **fields))
            assert got == want, (constraint.kind, sampling)
            assert want[2] == "end_turn", want  # the grammar ended it
        may_think = {"constraint": constraint, "sampling": GREEDY, "max_tokens": 40}
        want = await _run(plain, _job(repeating, f"t{i}", **may_think))
        assert (await _run(spec, _job(repeating, f"u{i}", **may_think))) == want
    assert _stats(spec).accepted_tokens > before  # drafts were verified under the grammar
    assert any(0 < a < n for n, a in checked)  # and some cut short by it
    assert spec.scheduler.cache.pool.used == 0


@pytest.mark.parametrize("pair", [MODELS[1]], indirect=True)
async def test_constrained_and_free_streams_speculate_side_by_side(
    pair: tuple[TorchBackend, TorchBackend],
) -> None:
    plain, spec = pair
    ids, repeating = _prompts()
    jobs = [
        ("c", repeating, {"constraint": CONSTRAINTS[0], "reasoning": NO_THINKING}),
        ("f", repeating, {}),
        ("j", ids, {"constraint": CONSTRAINTS[1], "reasoning": NO_THINKING}),
    ]

    async def batch(b: TorchBackend, tag: str) -> list[tuple[list[int], str, str | None]]:
        return list(
            await asyncio.gather(
                *(
                    _run(b, _job(prompt, f"{tag}{name}", sampling=GREEDY, max_tokens=48, **fields))
                    for name, prompt, fields in jobs
                )
            )
        )

    want = [
        await _run(plain, _job(p, f"a{n}", sampling=GREEDY, max_tokens=48, **f)) for n, p, f in jobs
    ]
    assert await batch(spec, "s") == want
    assert await batch(plain, "p") == want


@pytest.mark.parametrize("pair", [MODELS[1]], indirect=True)
async def test_a_reasoning_budget_and_a_forced_tool_call_match(
    pair: tuple[TorchBackend, TorchBackend],
) -> None:
    """Qwen3's model opens a reasoning block at once and stays in it: a budget forces the close
    marker (a forced row ends a draft that did not propose it), and the answer after it is
    free; a required tool call is a grammar in the model's own syntax, parsed into events."""
    plain, spec = pair
    _, repeating = _prompts()
    budget = ReasoningControl(budget_tokens=6, explicit=True)
    tool: dict[str, object] = {"tools": [WEATHER], "tool_choice": ToolChoice(mode="required")}
    cases: list[dict[str, object]] = [
        {"reasoning": budget, "sampling": GREEDY, "max_tokens": 48},
        *(
            {**tool, "reasoning": NO_THINKING, "sampling": SamplingParams(temperature=1.0, seed=n)}
            for n in range(3)
        ),
    ]
    before = _stats(spec).accepted_tokens
    for i, fields in enumerate(cases):
        want = await _run(plain, _job(repeating, f"p{i}", **fields))
        assert (await _run(spec, _job(repeating, f"s{i}", **fields))) == want, fields
        if "tools" in fields:
            assert want[2] == "tool_use", want
        else:
            assert want[1], want  # the forced close ended the block: an answer followed
    assert _stats(spec).accepted_tokens > before
