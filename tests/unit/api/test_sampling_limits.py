"""One set of sampling limits for every wire format (``services.api.wire.sampling``).

Each format maps its own field names onto the job; the ranges must be the same everywhere, and
each refusal names the field as the caller's format spells it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from services.api.wire import (
    anthropic_messages,
    ollama,
    openai_chat,
    openai_completions,
    openai_responses as responses,
)
from services.api.wire.native import parse_job
from services.api.wire.sampling import LIMITS, SamplingLimits, check_sampling, vllm_top_k
from shared.errors import InvalidRequest
from shared.jobs import GenerateRequest, SamplingParams

Parse = Callable[[dict[str, object]], SamplingParams]
USER = {"role": "user", "content": "hi"}


def chat(fields: dict[str, object]) -> SamplingParams:
    body = {"model": "m", "messages": [USER], **fields}
    return openai_chat.parse_request(json.dumps(body).encode(), request_id="c").job.sampling


def completions(fields: dict[str, object]) -> SamplingParams:
    body = json.dumps({"model": "m", "prompt": "hi", **fields}).encode()
    return openai_completions.parse_request(body, request_id="c").job.sampling


def native(fields: dict[str, object]) -> SamplingParams:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"text": "hi"}]}]}
    return parse_job(json.dumps({**body, "sampling": fields}).encode(), "r").sampling


def ollama_chat(fields: dict[str, object]) -> SamplingParams:
    body = {"model": "m", "messages": [USER], "options": fields}
    return ollama.parse_chat(json.dumps(body).encode(), request_id="o").job.sampling


def responses_job(fields: dict[str, object]) -> GenerateRequest:
    req = responses.parse_request(json.dumps({"model": "m", "input": "hi", **fields}).encode())
    conv = responses.input_messages(req, [])
    return responses.build_job(req, request_id="resp", conversation=conv, owner="", created=0)


def messages(fields: dict[str, object]) -> SamplingParams:
    body = {"model": "m", "max_tokens": 8, "messages": [USER], **fields}
    req = anthropic_messages.parse_request(json.dumps(body).encode())
    return anthropic_messages.build_job(req, request_id="msg").sampling


def refused(parse: Parse, fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(fields)
    assert info.value.param == param
    assert info.value.http_status == 400


# (field as the job names it, a value just out of range): every format refuses each one.
OUT_OF_RANGE = [
    ("temperature", 2.5),
    ("top_p", 1.5),
    ("min_p", -0.1),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 101.0),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_every_format_refuses_the_same_values(field: str, value: float) -> None:
    refused(chat, {field: value}, field)
    refused(completions, {field: value}, field)
    refused(native, {field: value}, f"sampling.{field}")
    ollama_name = "repeat_penalty" if field == "repetition_penalty" else field
    refused(ollama_chat, {ollama_name: value}, f"options.{ollama_name}")


@pytest.mark.parametrize(("field", "value"), [("temperature", 0.0), ("top_p", 0.0)])
def test_the_edges_are_accepted_everywhere(field: str, value: float) -> None:
    """top_p 0 keeps the most likely token; Responses used to refuse it while the others
    accepted it."""
    for parse in (chat, completions, native, ollama_chat):
        assert getattr(parse({field: value}), field) == value
    assert getattr(responses_job({field: value}).sampling, field) == value


def test_responses_uses_the_same_limits() -> None:
    refused(lambda f: responses_job(f).sampling, {"temperature": 2.5}, "temperature")
    refused(lambda f: responses_job(f).sampling, {"top_p": 1.5}, "top_p")
    refused(lambda f: responses_job(f).sampling, {"top_logprobs": 21}, "top_logprobs")


def test_anthropic_keeps_its_narrower_temperature_and_the_shared_rest() -> None:
    with pytest.raises(InvalidRequest):
        messages({"temperature": 1.5})  # Anthropic's own API allows up to 1
    assert messages({"temperature": 1.0, "top_k": 0}).top_k is None


def test_top_k_off_spellings_and_negative_values() -> None:
    """vLLM's "no top-k" is 0 or -1; any other negative value is an error in every format,
    where Chat used to take -5 silently as "no top-k"."""
    assert chat({"top_k": -1}).top_k is None and chat({"top_k": 0}).top_k is None
    assert chat({"top_k": 7}).top_k == 7
    refused(chat, {"top_k": -5}, "top_k")
    refused(completions, {"top_k": -5}, "top_k")
    refused(native, {"top_k": -1}, "sampling.top_k")
    refused(ollama_chat, {"top_k": -1}, "options.top_k")
    assert ollama_chat({"top_k": 0}).top_k is None


def test_top_logprobs_needs_logprobs_and_a_range() -> None:
    refused(chat, {"top_logprobs": 3}, "top_logprobs")
    refused(chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs")
    refused(native, {"top_logprobs": 3}, "sampling.top_logprobs")
    assert chat({"logprobs": True, "top_logprobs": 20}).top_logprobs == 20


def test_seed_takes_all_64_bits_unsigned_and_no_more() -> None:
    assert native({"seed": 2**64 - 1}).seed == 2**64 - 1
    refused(native, {"seed": 2**64}, "sampling.seed")


def test_one_table_one_check() -> None:
    """Every range lives on ``SamplingLimits``, and each names a ``SamplingParams`` field."""
    assert set(SamplingLimits.__struct_fields__) <= set(SamplingParams.__struct_fields__)
    narrow = SamplingLimits(temperature=(0.0, 0.5))
    with pytest.raises(InvalidRequest) as info:
        narrow.check(SamplingParams(temperature=0.7), lambda f: f"x.{f}")
    assert info.value.param == "x.temperature"
    assert LIMITS.check(SamplingParams(temperature=0.7)) == SamplingParams(temperature=0.7)
    with pytest.raises(InvalidRequest) as info:
        check_sampling(SamplingParams(repetition_penalty=0), "o.", {"repetition_penalty": "rp"})
    assert info.value.param == "rp"
    assert vllm_top_k(-1) is None and vllm_top_k(0) is None and vllm_top_k(-2) == -2
