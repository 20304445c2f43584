"""Drive a real ``OutputDecoder`` over scripted token ids, the way the engine does.

The script plays the model: its ids are fed one per step, except that a forced token
(``forced_next_token()``) replaces the model's pick, and the run ends on ``stop_reason`` or at
``max_tokens``. Every stream is returned complete (Start + deltas + finish events).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.worker.parsing.decoder import OutputDecoder
from services.worker.parsing.markers import detect_markers
from shared.events import AnyEvent, Start, TokenLogprob
from shared.jobs import GenerateRequest, ToolDef
from shared.model_card import ModelCard, ToolMarkers
from tests.invariants import check_stream, generated_token_ids
from tests.tiny_tokenizer import tiny_tokenizer

TOK = tiny_tokenizer()
EOS = TOK.token_to_id("<|im_end|>")
THINK, END_THINK = TOK.token_to_id("<think>"), TOK.token_to_id("</think>")
CALL, END_CALL = TOK.token_to_id("<tool_call>"), TOK.token_to_id("</tool_call>")
TOOL_CALLS, PYTHON_TAG = TOK.token_to_id("[TOOL_CALLS]"), TOK.token_to_id("<|python_tag|>")
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
REASONING, HERMES = detect_markers(TOK, HERMES_TEMPLATE)
MISTRAL = ToolMarkers(style="mistral", open="[TOOL_CALLS]", open_id=TOOL_CALLS)
LLAMA3 = ToolMarkers(style="llama3_json", open="<|python_tag|>", open_id=PYTHON_TAG)
WEATHER, TIME = ToolDef(name="get_weather"), ToolDef(name="get_time")


def ids(text: str) -> list[int]:
    """Token ids of plain text (added tokens in it stay text only if spelled out by callers)."""
    return TOK.encode(text, add_special_tokens=False).ids


def make_card(tools: ToolMarkers | None = HERMES, *, reasoning: bool = True) -> ModelCard:
    return ModelCard(
        name="tiny",
        architecture="llama",
        context_length=4096,
        tokenizer_json="",
        chat_template=HERMES_TEMPLATE,
        eos_token_ids=[EOS],
        reasoning=REASONING if reasoning else None,
        tools=tools,
    )


def make_job(**fields: object) -> GenerateRequest:
    fields.setdefault("tools", [WEATHER, TIME])
    fields.setdefault("request_id", "req_test")
    return GenerateRequest(model="tiny", **fields)  # type: ignore[arg-type]


def drive(
    script: Sequence[int],
    *,
    job: GenerateRequest | None = None,
    card: ModelCard | None = None,
    starts_in_reasoning: bool = False,
    max_tokens: int | None = None,
    logprobs: bool = False,
) -> list[AnyEvent]:
    """Run the decoder over ``script``; returns the checked, complete event stream."""
    job = job or make_job()
    decoder = OutputDecoder(
        tokenizer=TOK,
        card=card or make_card(),
        job=job,
        prompt_tokens=7,
        cached_tokens=2,
        starts_in_reasoning=starts_in_reasoning,
    )
    events: list[AnyEvent] = [Start(request_id=job.request_id, model="tiny", prompt_tokens=7)]
    fed: list[int] = []
    pending = list(script)
    reason = "end_turn"
    while decoder.stop_reason is None:
        if max_tokens is not None and len(fed) >= max_tokens:
            reason = "max_tokens"
            break
        forced = decoder.forced_next_token()
        if forced is None and not pending:
            reason = "max_tokens"  # the script ran out: treat as the length limit
            break
        token = forced if forced is not None else pending.pop(0)
        lp = TokenLogprob(token=TOK.id_to_token(token) or "", logprob=-0.5) if logprobs else None
        fed.append(token)
        events += decoder.feed(token, lp)
    events += decoder.finish(decoder.stop_reason or reason)  # type: ignore[arg-type]
    check_stream(events)
    assert generated_token_ids(events) == fed
    return events
