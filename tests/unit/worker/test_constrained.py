"""Constrained decoding in the real engine: tiny random models and the forced-sequence double.

A random-weight model writes noise, so whatever valid JSON, choice or regex match comes out is
the constraint's doing (checked: the same job unconstrained does not validate). The forced
double shows that reasoning stays free, that the constraint starts after the block closes (also
when a budget forces the close), and that output already valid passes through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest
import torch

from services.worker.loaders import load_model
from services.worker.torch_backend import TorchBackend
from shared.events import AnyEvent, Finish, ReasoningDelta, TextDelta, ToolCallEnd, ToolCallStart
from shared.jobs import (
    Constraint,
    GenerateRequest,
    Message,
    ReasoningControl,
    SamplingParams,
    TextPart,
    ToolChoice,
    ToolDef,
)
from tests.forced_model import forced_backend
from tests.invariants import check_stream, generated_token_ids
from tests.job_factory import as_job
from tests.worker_models import write_hf_model

torch.set_num_threads(1)

NO_THINKING = {"enable_thinking": False}
SCHEMAS: list[dict[str, object]] = [
    {  # nested object, enum, bounded integer, optional field
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome", "Oslo"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 999},
            "where": {
                "type": "object",
                "properties": {"north": {"type": "boolean"}},
                "required": ["north"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "where"],
        "additionalProperties": False,
    },
    {  # array of bounded strings, anyOf
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "score": {"anyOf": [{"type": "null"}, {"type": "integer", "maximum": 9, "minimum": 0}]},
        },
        "required": ["tags", "score"],
        "additionalProperties": False,
    },
    {  # a string format the library supports
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
        "additionalProperties": False,
    },
]
WEATHER = ToolDef(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    write_hf_model(path, "Qwen3ForCausalLM", seed=11, max_position_embeddings=1024)
    return path


@pytest.fixture
async def backend(tiny_dir: Path) -> AsyncIterator[TorchBackend]:
    b = TorchBackend(load_model(str(tiny_dir)), max_batch=4)
    await b.start()
    yield b
    await b.stop()


def job(rid: str = "r1", **kw: object) -> GenerateRequest:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    kw.setdefault("chat_template_kwargs", NO_THINKING)
    kw.setdefault("max_tokens", 120)
    return GenerateRequest(
        request_id=rid,
        model="tiny",
        messages=[Message(role="user", content=[TextPart(text="Describe a city")])],
        **kw,  # type: ignore[arg-type]
    )


async def run(
    b: TorchBackend, j: GenerateRequest, resume: list[int] | None = None
) -> list[AnyEvent]:
    events: list[AnyEvent] = []
    async for batch in b.generate(as_job(j, b), resume or [], 1):
        events.extend(batch)
    check_stream(events)
    return events


def text(events: list[AnyEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def finish(events: list[AnyEvent]) -> Finish:
    last = events[-1]
    assert isinstance(last, Finish)
    return last


def validates(answer: str, schema: dict[str, object]) -> bool:
    try:
        jsonschema.validate(json.loads(answer), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("schema", SCHEMAS)
async def test_json_schema_answers_validate_across_seeds_and_temperatures(
    backend: TorchBackend, schema: dict[str, object]
) -> None:
    constraint = Constraint(kind="json_schema", json_schema=schema)
    free = text(await run(backend, job(sampling=SamplingParams(temperature=0.0))))
    assert not validates(free, schema)  # the random model alone writes noise
    for temperature, seed in [(0.0, None), (0.7, 1), (1.0, 2), (1.3, 3)]:
        sampling = SamplingParams(temperature=temperature, seed=seed)
        events = await run(backend, job(constraint=constraint, sampling=sampling))
        assert validates(text(events), schema), text(events)
        assert finish(events).reason == "end_turn"  # no EOS step needed once the grammar ends


async def test_choice_and_regex(backend: TorchBackend) -> None:
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        got = text(
            await run(
                backend,
                job(constraint=Constraint(kind="choice", choices=choices), sampling=sampling),
            )
        )
        assert got in choices
        pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}"
        got = text(
            await run(
                backend, job(constraint=Constraint(kind="regex", regex=pattern), sampling=sampling)
            )
        )
        assert re.fullmatch(pattern, got), got


async def test_lark_grammar(backend: TorchBackend) -> None:
    grammar = 'start: "(" num " + " num ")"\nnum: /[1-9][0-9]?/'
    got = text(await run(backend, job(constraint=Constraint(kind="grammar", grammar=grammar))))
    assert re.fullmatch(r"\([1-9][0-9]? \+ [1-9][0-9]?\)", got), got


async def test_a_mixed_batch_leaves_free_sequences_untouched(backend: TorchBackend) -> None:
    free_alone = generated_token_ids(await run(backend, job("f", max_tokens=24, ignore_eos=True)))
    schema = SCHEMAS[0]
    constrained = job("c", constraint=Constraint(kind="json_schema", json_schema=schema))
    together = await asyncio.gather(
        run(backend, job("f", max_tokens=24, ignore_eos=True)),
        run(backend, constrained),
        run(backend, job("f2", max_tokens=24, ignore_eos=True)),
    )
    assert generated_token_ids(together[0]) == free_alone
    assert generated_token_ids(together[2]) == free_alone
    assert validates(text(together[1]), schema)


async def test_max_tokens_cuts_a_constrained_answer_as_usual(backend: TorchBackend) -> None:
    constraint = Constraint(kind="json_schema", json_schema=SCHEMAS[1])
    events = await run(backend, job(constraint=constraint, max_tokens=3))
    assert finish(events).reason == "max_tokens"
    assert text(events).startswith("{")


async def test_resumed_constrained_answer_stays_valid(backend: TorchBackend) -> None:
    """A continuation after a lost worker replays the published tokens into the matcher."""
    constraint = Constraint(kind="json_schema", json_schema=SCHEMAS[0])
    full = await run(backend, job(constraint=constraint))
    ids = generated_token_ids(full)
    cut = len(ids) // 2
    rest = await run(backend, job(constraint=constraint), resume=ids[:cut])
    assert ids[:cut] + generated_token_ids(rest) == ids


@pytest.mark.parametrize(
    "choice", [ToolChoice(mode="required"), ToolChoice(mode="named", name="get_weather")]
)
async def test_forced_tool_call_in_the_models_own_syntax(
    backend: TorchBackend, choice: ToolChoice
) -> None:
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    other = ToolDef(name="get_time", parameters=closed)
    for seed in range(3):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        j = job(
            tools=[WEATHER, other], tool_choice=choice, sampling=sampling, parallel_tool_calls=False
        )
        events = await run(backend, j)
        ends = [e for e in events if isinstance(e, ToolCallEnd)]
        starts = [e for e in events if isinstance(e, ToolCallStart)]
        assert ends and finish(events).reason == "tool_use"
        if choice.mode == "named" or starts[0].name == "get_weather":
            assert starts[0].name == "get_weather"
            assert validates(ends[0].arguments, WEATHER.parameters)


async def test_strict_tool_under_auto_gets_valid_arguments_or_text(backend: TorchBackend) -> None:
    strict = ToolDef(name=WEATHER.name, parameters=WEATHER.parameters, strict=True)
    for seed in range(4):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        events = await run(backend, job(tools=[strict], sampling=sampling))
        for end in (e for e in events if isinstance(e, ToolCallEnd)):
            assert validates(end.arguments, WEATHER.parameters)


async def test_reasoning_is_free_and_the_answer_constrained_after_it() -> None:
    b = forced_backend("<think>Let me weigh it.</think>Paris is lovely")
    await b.start()
    try:
        choice = Constraint(kind="choice", choices=["yes", "no"])
        events = await run(b, job(constraint=choice, chat_template_kwargs={}))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        assert reasoning == "Let me weigh it."
        assert text(events) in ("yes", "no")
        budget = ReasoningControl(budget_tokens=2, explicit=True)
        events = await run(
            b, job("r2", constraint=choice, reasoning=budget, chat_template_kwargs={})
        )
        assert 0 < len("".join(e.text for e in events if isinstance(e, ReasoningDelta))) < 16
        assert text(events) in ("yes", "no")
    finally:
        await b.stop()


async def test_valid_output_passes_through_unchanged() -> None:
    answer = '{"city": "Rome", "where": {"north": false}}'
    b = forced_backend(answer)
    await b.start()
    try:
        constraint = Constraint(kind="json_schema", json_schema=SCHEMAS[0])
        assert text(await run(b, job(constraint=constraint))) == answer
    finally:
        await b.stop()
