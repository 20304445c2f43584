"""The scripted backend: every scenario is a valid stream, limits hold, resume is seamless."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from services.worker.scripted import SCENARIOS, ScriptedBackend, ScriptedFailure, parse_spec
from shared.errors import InvalidRequest
from shared.events import AnyEvent, Finish, Start, TextDelta, ToolCallEnd, Usage
from shared.jobs import GenerateRequest, Message, TextPart, ToolDef
from shared.model_card import decode_card, encode_card
from shared.prompt import PromptRenderer
from tests.invariants import check_stream, generated_token_ids
from tests.job_factory import as_job


def job(script: str, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        request_id="req-s",
        model="scripted-text",
        messages=[Message(role="user", content=[TextPart("echo these words")])],
        metadata={"script": script},
        **kw,  # type: ignore[arg-type]
    )


async def run(
    b: ScriptedBackend, j: GenerateRequest, resume: list[int] | None = None, attempt: int = 1
) -> tuple[list[AnyEvent], Exception | None]:
    out: list[AnyEvent] = []
    try:
        async for batch in b.generate(as_job(j, b), resume or [], attempt):
            assert batch, "empty batch"
            out.extend(batch)
    except Exception as exc:
        return out, exc
    return out, None


@pytest.fixture
def backend() -> ScriptedBackend:
    return parse_spec("scripted:text?rate=0")


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_every_scenario_is_a_valid_stream(backend: ScriptedBackend, scenario: str) -> None:
    events, exc = await run(backend, job(scenario))
    if scenario == "error":
        assert isinstance(exc, ScriptedFailure)
        check_stream(events, complete=False)
        assert any(isinstance(e, TextDelta) for e in events)
        return
    assert exc is None
    check_stream(events)
    usage, finish = events[-2], events[-1]
    assert isinstance(usage, Usage) and isinstance(finish, Finish)
    assert usage.output_tokens == len(generated_token_ids(events))
    assert usage.input_tokens == backend.prompt_tokens(as_job(job(scenario), backend)) > 0
    # The ids are the real tokenization of what the "model" wrote, markers included.
    text = backend.tokenizer.decode(generated_token_ids(events), skip_special_tokens=False)
    assert backend.encode(text) == generated_token_ids(events)


async def test_tool_calls_are_hermes_text(backend: ScriptedBackend) -> None:
    j = job("parallel_tool_calls", tools=[ToolDef(name="lookup", parameters={})])
    events, _ = await run(backend, j)
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [json.loads(e.arguments) for e in ends] == [{"city": "Paris"}, {"city": "Oslo"}]
    text = backend.tokenizer.decode(generated_token_ids(events), skip_special_tokens=False)
    assert text.count('<tool_call>\n{"name": "lookup", "arguments": {"city": ') == 2
    assert isinstance(events[-1], Finish) and events[-1].reason == "tool_use"


async def test_echo_and_stop_sequence(backend: ScriptedBackend) -> None:
    events, _ = await run(backend, job("echo"))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "echo these words"
    events, _ = await run(backend, job("stop_sequence", stop=["5"]))
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "stop_sequence"
    assert finish.stop_sequence == "5" and finish.token_ids == backend.encode("5")
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "1, 2, 3, 4, "


@pytest.mark.parametrize("limit", [0, 1, 3, 7, 40])
@pytest.mark.parametrize("scenario", ["text", "reasoning", "tool_call", "long"])
async def test_max_tokens_is_honoured(backend: ScriptedBackend, scenario: str, limit: int) -> None:
    events, _ = await run(backend, job(scenario, max_tokens=limit))
    check_stream(events)
    ids = generated_token_ids(events)
    full, _ = await run(backend, job(scenario))
    if len(generated_token_ids(full)) - len(full[-1].token_ids) > limit:  # type: ignore[union-attr]
        assert isinstance(events[-1], Finish) and events[-1].reason == "max_tokens"
        assert len(ids) == limit
    assert ids == generated_token_ids(full)[: len(ids)]


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "error"])
async def test_resume_at_every_cut_is_seamless(backend: ScriptedBackend, scenario: str) -> None:
    full, _ = await run(backend, job(scenario))
    cuts = range(1, len(full) - 1) if scenario != "long" else (1, 2, 300, len(full) - 2)
    for cut in cuts:
        published = full[:cut]
        resumed, exc = await run(backend, job(scenario), generated_token_ids(published), 2)
        assert exc is None
        assert isinstance(resumed[0], Start) and resumed[0].attempt == 2
        assert published + resumed[1:] == full, f"cut at {cut}"


async def test_resume_that_does_not_match_is_refused(backend: ScriptedBackend) -> None:
    _, exc = await run(backend, job("text"), [1, 2, 3])
    assert isinstance(exc, InvalidRequest)


def test_card_is_a_labelled_test_double() -> None:
    b = parse_spec("scripted:reasoning?rate=5&max_batch=3", name="custom")
    assert (b.rate, b.max_batch, b.card.name) == (5.0, 3, "custom")
    card = decode_card(encode_card(b.card))
    assert card.architecture == "scripted" and "test double" in card.source
    tok = Tokenizer.from_str(card.tokenizer_json)
    assert card.reasoning is not None and card.tools is not None
    assert tok.token_to_id("<think>") == card.reasoning.open_id
    assert tok.token_to_id("</tool_call>") == card.tools.close_id
    assert tok.token_to_id("<|im_end|>") in card.eos_token_ids
    assert parse_spec("scripted:long").card.name == "scripted-long"


@pytest.mark.parametrize(
    "spec", ["scripted:nope", "scripted:text?rate=-1", "scripted:text?speed=3", "scripted:text?x"]
)
def test_bad_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        parse_spec(spec)


def test_chat_template_is_chatml(backend: ScriptedBackend) -> None:
    rendered = PromptRenderer(backend.card).render(job("text"))
    assert rendered.text.endswith(
        "<|im_start|>user\necho these words<|im_end|>\n<|im_start|>assistant\n"
    )
    assert list(rendered.token_ids) == backend.encode(rendered.text)
    assert backend.prompt_tokens(as_job(job("text"), backend)) == len(rendered.token_ids)
