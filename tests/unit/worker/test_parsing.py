"""Parsing parts on their own, and split invariance of the whole decoder (hypothesis).

Split invariance: the same output text, tokenized in any way the vocabulary allows (so markers,
multi-byte characters, JSON and stop strings fall across token boundaries at random), folds to
the same reasoning, text, tool calls and finish (vLLM #55195, SGLang #35564).
"""

from __future__ import annotations

import json
import random
from functools import lru_cache

import pytest
from hypothesis import given, settings, strategies as st

from services.worker.parsing.budget import reasoning_budget
from services.worker.parsing.detok import Detokenizer
from services.worker.parsing.markers import detect_markers
from services.worker.parsing.stops import StopMatcher
from services.worker.parsing.tool_calls import CallParser, Completed, Failed, Fragment, JsonScanner
from shared.accumulate import fold
from shared.jobs import ReasoningControl
from tests.tiny_tokenizer import tiny_tokenizer
from tests.unit.worker.decoder_harness import (
    CALL,
    END_CALL,
    END_THINK,
    EOS,
    THINK,
    TOK,
    drive,
    ids,
    make_job,
)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte <-> printable character table, which ByteLevel uses.
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@lru_cache(maxsize=1)
def byte_vocab() -> dict[bytes, int]:
    """Every non-added vocab entry as the bytes it decodes to."""
    back = {c: b for b, c in _bytes_to_unicode().items()}
    added = set(TOK.get_added_tokens_decoder())
    return {bytes(back[c] for c in tok): i for tok, i in TOK.get_vocab().items() if i not in added}


def random_ids(rng: random.Random, text: str) -> list[int]:
    """Tokenize ``text`` by a random walk over every vocab entry that matches at each byte."""
    raw, out, at = text.encode(), [], 0
    vocab = byte_vocab()
    longest = max(len(k) for k in vocab)
    while at < len(raw):
        options = [raw[at : at + n] for n in range(1, longest + 1) if raw[at : at + n] in vocab]
        pick = rng.choice(options)
        out.append(vocab[pick])
        at += len(pick)
    return out


CALL_BODY = (
    '\n{"name": "get_weather", "arguments": '
    '{"city": "Pa😀ris", "n": [1, -2.5e3, true, null], "s": "a\\"b\\\\"}}\n'
)
SEGMENTS = [
    ("reason", "Let me think 😀 about <tool_call> and naïve café."),
    ("marker", END_THINK),
    ("text", "Sure — checking “both” cities: "),
    ("marker", CALL),
    ("text", CALL_BODY),
    ("marker", END_CALL),
    ("marker", CALL),
    ("text", '{"name": "get_time", "arguments": {}}'),
    ("marker", END_CALL),
    ("text", " Done 東京."),
    ("marker", EOS),
]


def script(rng: random.Random, segments: list[tuple[str, object]]) -> list[int]:
    out: list[int] = []
    for kind, value in segments:
        out += [value] if kind == "marker" else random_ids(rng, str(value))  # type: ignore[list-item]
    return out


def summary(events: list[object]) -> tuple[object, ...]:
    done = fold(events)  # type: ignore[arg-type]
    calls = [(c.index, c.call_id, c.name, c.arguments) for c in done.tool_calls]
    finish = done.finish.reason if done.finish else None
    return done.reasoning, done.text, calls, finish


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_split_invariance_reasoning_text_and_calls(rng: random.Random) -> None:
    baseline = summary(drive(script_plain(SEGMENTS), starts_in_reasoning=True))
    assert summary(drive(script(rng, SEGMENTS), starts_in_reasoning=True)) == baseline
    reasoning, text, calls, finish = baseline
    assert reasoning == "Let me think 😀 about <tool_call> and naïve café."
    # The space after the calls only separates them from the text (shared.separators).
    assert text == "Sure — checking “both” cities: Done 東京."
    assert [c[2] for c in calls] == ["get_weather", "get_time"]  # type: ignore[index]
    assert json.loads(calls[0][3])["s"] == 'a"b\\'  # type: ignore[index]
    assert finish == "tool_use"


def script_plain(segments: list[tuple[str, object]]) -> list[int]:
    out: list[int] = []
    for kind, value in segments:
        out += [value] if kind == "marker" else ids(str(value))  # type: ignore[list-item]
    return out


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from(["4, 5", "😀!", ", 3", "é"]))
def test_split_invariance_stop_sequences(rng: random.Random, stop: str) -> None:
    text = "1, 2, 3 café 😀! 4, 5 and more"
    job = make_job(stop=[stop])
    events = drive([*random_ids(rng, text), EOS], job=job)
    done = fold(events)
    assert done.text == text[: text.index(stop)]
    assert done.finish is not None and done.finish.stop_sequence == stop


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_detokenizer_never_emits_broken_utf8(rng: random.Random) -> None:
    text = "naïve 😀🎉 東京 — “ok”"
    detok = Detokenizer(TOK)
    pieces = [detok.step(i) for i in random_ids(rng, text)] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_markers_are_found_from_added_tokens_without_model_names() -> None:
    reasoning, tools = detect_markers(TOK, "{{ messages }}")
    assert reasoning is not None and (reasoning.open_id, reasoning.close_id) == (THINK, END_THINK)
    assert tools is not None and tools.style == "hermes" and tools.close_id == END_CALL


def test_marker_pairs_need_both_ids_and_llama3_needs_the_template() -> None:
    from tokenizers import AddedToken, Tokenizer, models

    tok = Tokenizer(models.BPE())
    tok.add_tokens([AddedToken("<think>"), AddedToken("[THINK]"), AddedToken("[/THINK]")])
    reasoning, tools = detect_markers(tok, "plain")
    assert reasoning is not None and reasoning.open == "[THINK]" and tools is None
    _, llama = detect_markers(tok, '{"name": function name, "parameters": dictionary}')
    assert llama is not None and llama.style == "llama3_json" and llama.open_id is None
    tok.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    _, mistral = detect_markers(tok, "plain")
    assert mistral is not None and mistral.style == "mistral"
    assert detect_markers(tiny_tokenizer(), "x")[1] is not None


def test_stop_matcher_holds_partial_matches() -> None:
    stops = StopMatcher(["STOP", "END"])
    assert stops.push("abc S") == "abc "
    assert stops.push("T") == ""
    assert stops.push("x E") == "STx "
    assert stops.push("ND tail") == ""
    assert (stops.matched, stops.flush()) == ("END", "")


def test_json_scanner_accepts_json_and_rejects_the_rest() -> None:
    def scan(text: str) -> JsonScanner:
        s = JsonScanner()
        for ch in text:
            s.feed(ch)
        return s

    for good in ['{"a": [1, -2.5e+3, true, false, null, {"b": "\\u00e9\\n"}]}', "{}", '{"": []}']:
        assert scan(good).done and not scan(good).error, good
    for bad in ["{'a': 1}", '{"a": tru}', '{"a" 1}', '{"a": 1,}', '{"a": [1}', '{"a": "\\x"}']:
        assert scan(bad).error, bad
    assert not scan('{"a": [1, {"b"').done


def test_call_parser_streams_fragments_that_concatenate() -> None:
    parser = CallParser({"f"})
    text = '{"name": "f", "arguments": {"x": "a b", "y": [1, 2]}}'
    actions = [a for ch in text for a in parser.feed(ch)] + parser.finish()
    fragments = [a.text for a in actions if isinstance(a, Fragment)]
    assert all(f.strip() for f in fragments)
    done = [a for a in actions if isinstance(a, Completed)]
    assert done and "".join(fragments) == done[0].arguments == '{"x": "a b", "y": [1, 2]}'


@pytest.mark.parametrize(
    "text",
    [
        '["not", "a", "call"]',
        '{"arguments": {}, "name": "f"}',
        '{"name": "g", "arguments": {}}',
        "{",
    ],
)
def test_call_parser_fails_before_announcing_anything(text: str) -> None:
    parser = CallParser({"f"})
    actions = parser.feed(text) + parser.finish()
    assert [type(a) for a in actions] == [Failed]
    assert actions[0].raw == text  # type: ignore[union-attr]


def test_reasoning_budgets() -> None:
    assert reasoning_budget(ReasoningControl()) is None
    assert reasoning_budget(ReasoningControl(effort="none")) == 0
    assert reasoning_budget(ReasoningControl(effort="low", budget_tokens=9)) == 9
    assert reasoning_budget(ReasoningControl(effort="high")) is None
