"""Legacy Completions on the wire: request parsing, the prompt's token ids (FIM), projection.

The projector and ``render(fold(...))`` read the same events, so a streamed and a non-streamed
answer must agree; both are checked against one event stream here.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from tokenizers import AddedToken

from services.api.wire.openai_completions import (
    Context,
    Projector,
    build_prompt,
    echo_ids,
    parse_request,
    render,
    token_strings,
)
from services.api.wire.openai_completions.prompt import fim_tokens
from services.api.wire.sse import Frame
from shared.accumulate import fold
from shared.errors import InvalidRequest
from shared.events import AnyEvent, Error, Finish, Start, TextDelta, TokenLogprob, TopLogprob, Usage
from shared.model_card import ModelCard
from shared.prompt import PromptRenderer
from tests.tiny_tokenizer import tiny_tokenizer

FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "Once upon a time", **fields}).encode()


def renderer(*, fim: bool = True, bos: bool = False) -> PromptRenderer:
    tok = tiny_tokenizer()
    if fim:
        tok.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    card = ModelCard(
        name="m",
        architecture="llama",
        context_length=4096,
        tokenizer_json=tok.to_str(),
        chat_template="",
        bos_token="<|endoftext|>" if bos else None,
        add_bos_token=bos,
    )
    return PromptRenderer(card, tok)


def rejected(**fields: object) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_request(body(**fields), request_id="cmpl_1")
    return info.value


# -- request ---------------------------------------------------------------------------------


def test_defaults_are_openai_s() -> None:
    parsed = parse_request(body(), request_id="cmpl_1")
    job = parsed.job
    assert (job.origin, job.max_tokens, job.raw_text, job.messages) == (
        "openai_completions",
        16,
        True,
        [],
    )
    assert parsed.prompts == ["Once upon a time"] and parsed.suffix is None
    assert not parsed.options.stream and parsed.options.logprobs is None
    assert not job.sampling.logprobs


def test_fields_map_onto_the_job() -> None:
    parsed = parse_request(
        body(
            prompt=["one prompt"],
            max_tokens=5,
            temperature=0.2,
            top_p=0.9,
            seed=7,
            stop="\n",
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            user="u1",
            logprobs=3,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        ),
        request_id="cmpl_1",
    )
    job, opts = parsed.job, parsed.options
    assert parsed.prompts == ["one prompt"]
    assert (job.max_tokens, job.stop, job.user) == (5, ["\n"], "u1")
    s = job.sampling
    assert (s.temperature, s.top_p, s.seed, s.presence_penalty, s.frequency_penalty) == (
        0.2,
        0.9,
        7,
        0.5,
        -0.5,
    )
    assert (s.logprobs, s.top_logprobs) == (True, 3)
    assert (opts.stream, opts.include_usage, opts.echo, opts.logprobs) == (True, True, True, 3)


def test_logprobs_zero_still_asks_for_the_sampled_token() -> None:
    sampling = parse_request(body(logprobs=0), request_id="r").job.sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 0)


def test_token_id_prompts_are_accepted() -> None:
    assert parse_request(body(prompt=[1, 2, 3]), request_id="r").prompts == [[1, 2, 3]]
    assert parse_request(body(prompt=[[4, 5]]), request_id="r").prompts == [[4, 5]]


def test_a_prompt_batch_is_n_choices_per_prompt() -> None:
    """OpenAI's batch: choices are prompt 0's n, then prompt 1's, ... (index = prompt * n + j)."""
    parsed = parse_request(body(prompt=["a", [4, 5], "c"], n=2), request_id="r")
    assert parsed.prompts == ["a", [4, 5], "c"]
    assert (parsed.job.n, parsed.job.prompts) == (6, 3)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt": ["a", 5]}, "prompt[1]", "must be a string"),
        ({"prompt": [[1], []]}, "prompt[1]", "must be a string"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [{"x": 1}]}, "prompt[0]", "must be a string"),
        ({"n": 0}, "n", "at least 1"),
        ({"best_of": 3}, "best_of", "not supported"),
        ({"n": 2, "best_of": 3}, "best_of", "use n"),
        ({"echo": True, "suffix": "x"}, "echo", "cannot be used together"),
        ({"logprobs": 21}, "logprobs", "between"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"temperature": 3}, "temperature", "between"),
        ({"logit_bias": {"1": 2}}, "logit_bias", "not supported"),
        ({"prompt": 5}, "prompt", "Expected"),
        ({"max_tokens": "x"}, "max_tokens", "Expected"),
    ],
)
def test_bad_requests_are_400s_with_a_param(
    fields: dict[str, object], param: str, words: str
) -> None:
    err = rejected(**fields)
    assert err.http_status == 400 and err.param == param and words in err.message


def test_invalid_json_is_a_400() -> None:
    with pytest.raises(InvalidRequest):
        parse_request(b"{", request_id="r")


# -- prompt ------------------------------------------------------------------------------------


def test_raw_prompt_matches_added_tokens_and_no_template() -> None:
    r = renderer()
    built = build_prompt(r, "<|im_start|>Hello", None)
    assert built.token_ids[0] == r.tokenizer.token_to_id("<|im_start|>")
    assert built.text == "<|im_start|>Hello"
    assert r.tokenizer.decode(built.token_ids, skip_special_tokens=False) == built.text


def test_bos_is_prepended_where_the_card_wants_it() -> None:
    r = renderer(bos=True)
    bos = r.tokenizer.token_to_id("<|endoftext|>")
    assert build_prompt(r, "Hello", None).token_ids[0] == bos
    assert echo_ids(r, "Hello") == build_prompt(r, "Hello", None).token_ids[1:]


def test_fim_token_sequence_is_prefix_suffix_middle() -> None:
    r = renderer()
    pre, suf, mid = (r.tokenizer.token_to_id(t) for t in FIM)
    built = build_prompt(r, "def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    expected = [
        pre,
        *r.text_ids("def add(a, b):\n    return "),
        suf,
        *r.text_ids("\n\nprint(add(1, 2))"),
        mid,
    ]
    assert built.token_ids == expected
    assert (
        built.text
        == "<fim_prefix>def add(a, b):\n    return <fim_suffix>\n\nprint(add(1, 2))<fim_middle>"
    )


def test_fim_markers_inside_the_code_stay_text() -> None:
    r = renderer()
    suf = r.tokenizer.token_to_id("<fim_suffix>")
    built = build_prompt(r, "x = '<fim_suffix>'", "")
    assert built.token_ids.count(suf) == 1  # only the one sluice placed


def test_fim_spellings_are_found_by_name() -> None:
    tok = tiny_tokenizer()
    tok.add_special_tokens(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    found = fim_tokens(tok)
    assert found is not None and [name for name, _ in found] == [
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
    ]


def test_suffix_without_fim_tokens_is_a_clear_400() -> None:
    with pytest.raises(InvalidRequest) as info:
        build_prompt(renderer(fim=False), "a", "b")
    assert info.value.param == "suffix" and "fill-in-the-middle" in info.value.message


def test_prompt_token_ids_are_checked_against_the_vocabulary() -> None:
    r = renderer()
    assert build_prompt(r, [1, 2], None).token_ids == [1, 2]
    with pytest.raises(InvalidRequest):
        build_prompt(r, [10**9], None)
    with pytest.raises(InvalidRequest):
        build_prompt(r, [1], "suffix")


def test_empty_prompt_is_a_400() -> None:
    with pytest.raises(InvalidRequest):
        build_prompt(renderer(), "", None)


# -- projection --------------------------------------------------------------------------------


def lp(token: str, value: float) -> TokenLogprob:
    return TokenLogprob(
        token=token, logprob=value, top=[TopLogprob(token, value), TopLogprob("x", -9.0)]
    )


EVENTS: list[AnyEvent] = [
    Start(request_id="cmpl_1", model="m", prompt_tokens=3),
    TextDelta(text=" there", token_ids=[1], logprobs=[lp(" there", -0.1)]),
    TextDelta(text=" was a", token_ids=[2, 3], logprobs=[lp(" was", -0.2), lp(" a", -0.3)]),
    Usage(input_tokens=3, output_tokens=3),
    Finish(reason="max_tokens"),
]


def ctx(**fields: object) -> Context:
    return Context(id="cmpl_1", created=1, model="m", **fields)  # type: ignore[arg-type]


def chunks(frames: list[Frame]) -> list[dict[str, object]]:
    assert frames[-1].data == b"[DONE]"
    return [msgspec.json.decode(f.data) for f in frames[:-1]]


def project(c: Context, events: list[AnyEvent] = EVENTS) -> list[Frame]:
    p = Projector(c)
    return [f for e in events for f in p.feed(e)] + p.close()


def test_stream_is_text_chunks_then_finish() -> None:
    out = chunks(project(ctx()))
    assert all(c["object"] == "text_completion" and "usage" not in c for c in out)
    assert [c["choices"][0]["text"] for c in out] == [" there", " was a", ""]  # type: ignore[index]
    assert [c["choices"][0]["finish_reason"] for c in out] == [None, None, "length"]  # type: ignore[index]


def test_include_usage_adds_a_final_usage_chunk() -> None:
    out = chunks(project(ctx(include_usage=True)))
    assert all(c["usage"] is None for c in out[:-1])
    assert out[-1]["choices"] == [] and out[-1]["usage"]["total_tokens"] == 6  # type: ignore[index]


def test_streamed_and_rendered_answers_agree_with_echo_and_logprobs() -> None:
    c = ctx(logprobs=True, echo="Once", echo_tokens=["On", "ce"])
    out = chunks(project(c))
    body_ = msgspec.json.decode(msgspec.json.encode(render(fold(EVENTS), c)))
    choice = body_["choices"][0]
    assert choice["text"] == "Once there was a" == "".join(x["choices"][0]["text"] for x in out)
    assert choice["finish_reason"] == "length"
    merged: dict[str, list[object]] = {k: [] for k in choice["logprobs"]}
    for x in out:
        if x["choices"][0]["logprobs"]:  # type: ignore[index]
            for k, v in x["choices"][0]["logprobs"].items():  # type: ignore[index]
                merged[k] += v
    assert merged == choice["logprobs"]
    assert choice["logprobs"] == {
        "tokens": ["On", "ce", " there", " was", " a"],
        "token_logprobs": [None, None, -0.1, -0.2, -0.3],
        "top_logprobs": [
            None,
            None,
            {" there": -0.1, "x": -9.0},
            {" was": -0.2, "x": -9.0},
            {" a": -0.3, "x": -9.0},
        ],
        "text_offset": [0, 2, 4, 10, 14],
    }
    assert body_["usage"]["prompt_tokens"] == 3 and body_["object"] == "text_completion"


def test_echo_without_logprobs_leads_the_text() -> None:
    out = chunks(project(ctx(echo="Once")))
    assert out[0]["choices"][0] == {
        "index": 0,
        "text": "Once",
        "logprobs": None,
        "finish_reason": None,
    }  # type: ignore[index]


def test_an_error_after_the_headers_is_one_error_chunk() -> None:
    events: list[AnyEvent] = [EVENTS[0], Error(kind="internal", message="boom")]
    out = chunks(project(ctx(), events))
    assert out[-1]["error"]["message"] == "boom"  # type: ignore[index]


def test_token_strings_decode_each_id() -> None:
    r = renderer()
    ids = echo_ids(r, "Hello world")
    assert "".join(token_strings(r.tokenizer, ids)) == "Hello world"


def test_speculative_false_opts_the_request_out() -> None:
    assert parse_request(body(), request_id="r").job.speculative is True
    assert parse_request(body(speculative=False), request_id="r").job.speculative is False
