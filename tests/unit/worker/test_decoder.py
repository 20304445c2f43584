"""The output decoder over scripted tokens: reasoning, tool calls, stops, usage, token ids."""

from __future__ import annotations

import json

from services.worker.parsing.decoder import call_id
from shared.accumulate import fold
from shared.events import (
    Finish,
    ReasoningDelta,
    ReasoningEnd,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from shared.jobs import ReasoningControl, ToolChoice
from tests.unit.worker.decoder_harness import (
    CALL,
    END_CALL,
    END_THINK,
    EOS,
    LLAMA3,
    MISTRAL,
    PYTHON_TAG,
    THINK,
    TOOL_CALLS,
    drive,
    ids,
    make_card,
    make_job,
)

WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def hermes(body: str) -> list[int]:
    return [CALL, *ids(body), END_CALL]


def test_plain_text_ends_on_eos_with_usage() -> None:
    events = drive([*ids("Hello, world!"), EOS, *ids("never")])
    done = fold(events)
    assert done.text == "Hello, world!"
    assert done.finish == Finish(reason="end_turn", token_ids=[EOS])
    assert done.usage == Usage(
        input_tokens=7, output_tokens=len(ids("Hello, world!")) + 1, cached_tokens=2
    )


def test_prompt_opened_reasoning_then_answer() -> None:
    script = [*ids("The user greets me."), END_THINK, *ids("Hi there."), EOS]
    events = drive(script, starts_in_reasoning=True)
    done = fold(events)
    assert (done.reasoning, done.text) == ("The user greets me.", "Hi there.")
    end = next(e for e in events if isinstance(e, ReasoningEnd))
    assert end.token_ids == [END_THINK]
    assert (
        done.usage is not None
        and done.usage.reasoning_tokens == len(ids("The user greets me.")) + 1
    )


def test_model_opened_reasoning_marker_rides_on_first_delta() -> None:
    events = drive([THINK, *ids("hmm"), END_THINK, *ids("ok"), EOS])
    first = next(e for e in events if isinstance(e, ReasoningDelta))
    assert first.token_ids[0] == THINK
    assert "<think>" not in fold(events).text + fold(events).reasoning


def test_unterminated_reasoning_at_max_tokens_leaks_nothing() -> None:
    events = drive([THINK, *ids("Once upon a time there was a small model")], max_tokens=6)
    done = fold(events)
    assert done.text == "" and done.reasoning
    assert isinstance(events[-3], ReasoningEnd)
    assert done.finish is not None and done.finish.reason == "max_tokens"


def test_budget_forces_the_close_marker_and_the_answer_follows() -> None:
    job = make_job(reasoning=ReasoningControl(budget_tokens=3, explicit=True))
    script = [*ids("Once upon a time there was"), *ids("Hi."), EOS]
    events = drive(script, job=job, starts_in_reasoning=True)
    reasoning = [e for e in events if isinstance(e, ReasoningDelta)]
    assert sum(len(e.token_ids) for e in reasoning) == 3
    assert any(isinstance(e, ReasoningEnd) and e.token_ids == [END_THINK] for e in events)
    assert fold(events).text  # the model went on with its answer after the forced close


def test_effort_none_closes_a_block_the_template_could_not_prevent() -> None:
    job = make_job(reasoning=ReasoningControl(effort="none", explicit=True))
    events = drive([THINK, *ids("Hi."), EOS], job=job)
    assert fold(events).reasoning == ""
    assert [e.token_ids for e in events if isinstance(e, ReasoningEnd)] == [[THINK, END_THINK]]


def test_tool_call_inside_reasoning_is_reasoning() -> None:
    script = [
        THINK,
        *ids("maybe "),
        CALL,
        *ids(WEATHER_CALL),
        END_CALL,
        END_THINK,
        *ids("No."),
        EOS,
    ]
    done = fold(drive(script))
    assert done.tool_calls == [] and "get_weather" in done.reasoning
    assert done.finish is not None and done.finish.reason == "end_turn"


def test_streamed_call_then_tool_use() -> None:
    events = drive([*ids("Checking."), *hermes("\n" + WEATHER_CALL + "\n"), EOS])
    start = next(e for e in events if isinstance(e, ToolCallStart))
    assert (start.index, start.name, start.call_id) == (0, "get_weather", call_id("req_test", 0))
    assert start.token_ids[0] == CALL
    deltas = [e for e in events if isinstance(e, ToolCallArgsDelta)]
    assert len(deltas) > 1  # streamed, not emitted whole (Ollama #16212)
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.arguments == '{"city": "Paris"}' and end.token_ids[-1] == END_CALL
    done = fold(events)
    assert done.text == "Checking." and done.finish is not None and done.finish.reason == "tool_use"


def test_parallel_and_parameterless_calls_get_dense_indexes_and_distinct_ids() -> None:
    script = [
        *hermes(WEATHER_CALL),
        *ids("\n"),
        *hermes('{"name": "get_time", "arguments": {}}'),
        EOS,
    ]
    calls = fold(drive(script)).tool_calls
    assert [(c.index, c.name, c.arguments) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}'),
        (1, "get_time", "{}"),
    ]
    assert calls[0].call_id != calls[1].call_id


def test_missing_close_marker_between_calls_keeps_both_calls() -> None:
    script = [CALL, *ids(WEATHER_CALL), *hermes('{"name": "get_time", "arguments": {}}'), EOS]
    events = drive(script)
    assert [c.name for c in fold(events).tool_calls] == ["get_weather", "get_time"]


def test_eos_before_the_close_marker_still_ends_a_complete_call() -> None:
    events = drive([CALL, *ids(WEATHER_CALL + "\n"), EOS])
    done = fold(events)
    assert [c.arguments for c in done.tool_calls] == ['{"city": "Paris"}']
    assert done.finish == Finish(reason="tool_use", token_ids=[EOS])


def test_text_after_a_call_is_text() -> None:
    done = fold(drive([*hermes(WEATHER_CALL), *ids(" Done."), EOS]))
    # The space after the call separates it from the text (shared.separators).
    assert done.text == "Done." and len(done.tool_calls) == 1


def test_parallel_tool_calls_false_stops_after_the_first_call() -> None:
    script = [*hermes(WEATHER_CALL), *hermes('{"name": "get_time", "arguments": {}}'), EOS]
    events = drive(script, job=make_job(parallel_tool_calls=False))
    assert len(fold(events).tool_calls) == 1
    assert fold(events).finish == Finish(reason="tool_use", token_ids=[])


def test_unicode_in_arguments_is_never_broken() -> None:
    body = '{"name": "get_weather", "arguments": {"city": "東京 😀", "note": "café"}}'
    events = drive([*hermes(body), EOS])
    assert json.loads(fold(events).tool_calls[0].arguments) == {"city": "東京 😀", "note": "café"}
    for e in events:
        if isinstance(e, ToolCallArgsDelta):
            assert "\ufffd" not in e.fragment


def test_malformed_call_before_start_degrades_to_visible_text() -> None:
    body = "{'name': 'get_weather', 'arguments': {}}"
    done = fold(drive([*hermes(body), EOS]))
    assert done.tool_calls == []
    assert done.text == f"<tool_call>{body}</tool_call>"
    assert done.finish is not None and done.finish.reason == "end_turn"


def test_unknown_tool_name_degrades_to_text() -> None:
    body = '{"name": "rm_rf", "arguments": {"path": "/"}}'
    done = fold(drive([*hermes(body), EOS]))
    assert done.tool_calls == [] and done.text == f"<tool_call>{body}</tool_call>"


def test_bad_json_after_start_ends_the_turn_cleanly() -> None:
    body = '{"name": "get_weather", "arguments": {"city": Paris}}'
    events = drive([*hermes(body), *ids("more text"), EOS])
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    assert fold(events).finish is not None
    assert fold(events).finish.reason == "end_turn"  # type: ignore[union-attr]


def test_call_truncated_by_max_tokens_finishes_cleanly() -> None:
    script = [CALL, *ids('{"name": "get_weather", "arguments": {"city": "Par')]
    events = drive(script)
    assert any(isinstance(e, ToolCallStart) for e in events)
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    done = fold(events)
    assert done.finish is not None and done.finish.reason == "max_tokens"
    assert done.tool_calls[0].arguments == '{"city": "Par'


def test_tool_choice_none_disables_parsing() -> None:
    job = make_job(tool_choice=ToolChoice(mode="none"))
    done = fold(drive([*hermes(WEATHER_CALL), EOS], job=job))
    assert done.tool_calls == [] and done.text == f"<tool_call>{WEATHER_CALL}</tool_call>"


def test_call_ids_are_reproducible_for_a_resumed_decoder() -> None:
    first = fold(drive([*hermes(WEATHER_CALL), EOS])).tool_calls[0].call_id
    again = fold(drive([*hermes(WEATHER_CALL), EOS])).tool_calls[0].call_id
    other = fold(drive([*hermes(WEATHER_CALL), EOS], job=make_job(request_id="req_other")))
    assert first == again == call_id("req_test", 0) != other.tool_calls[0].call_id


def test_mistral_list_of_calls() -> None:
    body = f' [{WEATHER_CALL}, {{"name": "get_time", "arguments": {{}}}}]'
    events = drive([*ids("Sure."), TOOL_CALLS, *ids(body), EOS], card=make_card(MISTRAL))
    done = fold(events)
    assert [c.name for c in done.tool_calls] == ["get_weather", "get_time"]
    assert done.text == "Sure." and done.finish is not None and done.finish.reason == "tool_use"


def test_mistral_call_with_an_id_key_after_the_arguments() -> None:
    body = ' [{"name": "get_time", "arguments": {}, "id": "abc123xyz"}]'
    done = fold(drive([TOOL_CALLS, *ids(body), EOS], card=make_card(MISTRAL)))
    assert [(c.name, c.arguments) for c in done.tool_calls] == [("get_time", "{}")]
    assert done.text == ""


def test_named_tool_choice_accepts_only_that_tool() -> None:
    job = make_job(tool_choice=ToolChoice(mode="named", name="get_time"))
    done = fold(drive([*hermes(WEATHER_CALL), EOS], job=job))
    assert done.tool_calls == [] and "get_weather" in done.text


def test_llama3_json_reply_is_a_call_and_prose_is_not() -> None:
    card = make_card(LLAMA3, reasoning=False)
    body = ' {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    done = fold(drive([*ids(body), EOS], card=card))
    assert [(c.name, c.arguments) for c in done.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    tagged = fold(drive([PYTHON_TAG, *ids(body), EOS], card=card))
    assert tagged.tool_calls[0].arguments == '{"city": "Oslo"}'
    prose = fold(drive([*ids("Use {curly} braces."), EOS], card=card))
    assert prose.text == "Use {curly} braces." and prose.tool_calls == []
    not_a_call = fold(drive([*ids(' {"city": "Oslo"}'), EOS], card=card))
    assert not_a_call.text == ' {"city": "Oslo"}' and not_a_call.tool_calls == []


def test_stop_sequence_is_never_emitted_and_its_tokens_ride_on_finish() -> None:
    job = make_job(stop=["4,"])
    script = ids("1, 2, 3, 4, 5.")
    events = drive(script, job=job)
    done = fold(events)
    assert done.text == "1, 2, 3, "
    assert done.finish is not None and done.finish.reason == "stop_sequence"
    assert done.finish.stop_sequence == "4,"
    assert done.finish.token_ids  # the matched text's tokens
    assert all("4" not in e.text for e in events if isinstance(e, TextDelta))


def test_partial_stop_match_is_released_when_it_diverges() -> None:
    done = fold(drive([*ids("1, 2, 3"), EOS], job=make_job(stop=["3, 4"])))
    assert done.text == "1, 2, 3" and done.finish is not None and done.finish.reason == "end_turn"


def test_logprobs_ride_on_text_deltas() -> None:
    events = drive([*ids("Hello"), EOS], logprobs=True)
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert all(e.logprobs is not None and len(e.logprobs) == len(e.token_ids) for e in deltas)


def test_ignore_eos_keeps_generating() -> None:
    events = drive([*ids("a"), EOS, *ids("b")], job=make_job(ignore_eos=True))
    done = fold(events)
    assert done.text == "ab" and done.finish is not None and done.finish.reason == "max_tokens"
