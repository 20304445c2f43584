"""The scripted backend: a test double that replays a fixed event script, not a model.

``--model scripted:<scenario>[?rate=<tokens/s>&max_batch=<n>&ctx=<tokens>]`` serves a fake
"model" whose answers are written in this file. It exists so the bus, the API and every wire
format can be tested and benchmarked end to end without weights: the tokenizer (byte-level, with
the ChatML, reasoning and tool-call marker tokens added), the chat template, the model card,
Redis and the API are all real; only the choice of tokens is scripted. Its card says
``architecture="scripted"``.

Every event's ``token_ids`` are the real tokenization of the text the script "generates", so the
concatenated ids decode to what a model would have written (markers included). The full event
list is a pure function of the job, which makes failover seamless: a continuation skips the events
whose tokens were already published and emits exactly what a first attempt would have.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Callable
from urllib.parse import parse_qs

from tokenizers import AddedToken, Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from shared.errors import InvalidRequest
from shared.events import (
    AnyEvent,
    Finish,
    ReasoningDelta,
    ReasoningEnd,
    Start,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from shared.jobs import Job
from shared.model_card import ModelCard, ReasoningMarkers, ToolMarkers

__all__ = ["SCENARIOS", "ScriptedBackend", "ScriptedFailure", "build_tokenizer", "parse_spec"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% endif %}"
    "{% for tc in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": '
    "{{ tc.function.arguments if tc.function.arguments is string "
    "else tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SCENARIOS = (
    "text",
    "reasoning",
    "tool_call",
    "parallel_tool_calls",
    "parameterless_tool_call",
    "stop_sequence",
    "error",
    "echo",
    "long",
)
LONG_WORDS = 600  # "long": enough pieces that cancel and failover tests can cut it mid-way
_PIECE = re.compile(r"\s*\S+|\s+")


class ScriptedFailure(RuntimeError):
    """What the ``error`` scenario raises mid-stream (the job turns it into an ``Error``)."""


def build_tokenizer() -> Tokenizer:
    """A byte-level tokenizer (one token per byte, no merges) plus the marker tokens."""
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (IM_START, IM_END)])
    markers = (THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE)
    tok.add_special_tokens([AddedToken(t, special=False, normalized=False) for t in markers])
    return tok


def parse_spec(spec: str, name: str | None = None) -> ScriptedBackend:
    """Build a backend from ``scripted:<scenario>[?rate=<tokens/s>&max_batch=<n>&ctx=<n>]``.

    ``ctx`` is the context length the card advertises (default 4096); agent clients whose
    prompts run to tens of thousands of (byte) tokens need more.

    Raises:
        ValueError: unknown scenario or a malformed parameter.
    """
    body = spec.removeprefix("scripted:")
    scenario, _, query = body.partition("?")
    scenario = scenario or "text"
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scripted scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    params = {k: v[-1] for k, v in parse_qs(query, strict_parsing=bool(query)).items()}
    unknown = set(params) - {"rate", "max_batch", "ctx"}
    if unknown:
        raise ValueError(f"unknown scripted parameter(s): {', '.join(sorted(unknown))}")
    rate = float(params.get("rate", 20))
    max_batch = int(params.get("max_batch", 16))
    context = int(params.get("ctx", 4096))
    if rate < 0 or max_batch < 1 or context < 64:
        raise ValueError("rate must be >= 0, max_batch >= 1 and ctx >= 64")
    return ScriptedBackend(scenario, rate=rate, max_batch=max_batch, name=name, context=context)


class ScriptedBackend:
    """Implements ``services.worker.backend.Backend`` by replaying a scenario at a token rate.

    ``rate`` is tokens per second per sequence (0 = as fast as possible); each event is one
    "step" and waits ``len(event.token_ids) / rate`` before it is yielded.
    """

    def __init__(
        self,
        scenario: str = "text",
        *,
        rate: float = 20.0,
        max_batch: int = 16,
        name: str | None,
        context: int = 4096,
    ) -> None:
        """Build the tokenizer and the card; ``name`` defaults to ``scripted-<scenario>``."""
        self.scenario = scenario
        self.rate = rate
        self.max_batch = max_batch
        self.tokenizer = build_tokenizer()
        ids = {t: self._id(t) for t in (IM_END, THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE)}
        self.eos_id = ids[IM_END]
        self.card = ModelCard(
            name=name or f"scripted-{scenario}",
            architecture="scripted",
            context_length=context,
            tokenizer_json=self.tokenizer.to_str(),
            chat_template=CHAT_TEMPLATE,
            eos_token=IM_END,
            eos_token_ids=[self.eos_id],
            reasoning=ReasoningMarkers(THINK_OPEN, THINK_CLOSE, ids[THINK_OPEN], ids[THINK_CLOSE]),
            tools=ToolMarkers(
                style="hermes",
                open=TOOL_OPEN,
                close=TOOL_CLOSE,
                open_id=ids[TOOL_OPEN],
                close_id=ids[TOOL_CLOSE],
            ),
            source=f"scripted:{scenario} (test double, no weights)",
        )

    def _id(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        assert found is not None, token
        return found

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (marker strings become their marker ids)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    async def start(self) -> None:
        """Nothing to start: the script runs inside ``generate``."""

    async def stop(self) -> None:
        """Nothing to stop."""

    def prompt_tokens(self, job: Job) -> int:
        """Prompt length: the API's token ids."""
        return len(job.prompt_token_ids)

    async def generate(
        self, job: Job, resume_token_ids: list[int], attempt: int
    ) -> AsyncIterator[list[AnyEvent]]:
        """Yield the script one event per step, skipping what ``resume_token_ids`` covers.

        Raises:
            InvalidRequest: the resumed ids are not a prefix of this job's script.
            ScriptedFailure: the ``error`` scenario, after its partial output.
        """
        scenario = job.metadata.get("script", self.scenario)
        if scenario not in SCENARIOS:
            raise InvalidRequest(f"unknown scripted scenario {scenario!r}", param="metadata")
        events, fail = self.script(job, scenario)
        skip = _resume_point(events, resume_token_ids)
        prompt_tokens = self.prompt_tokens(job)
        yield [
            Start(
                request_id=job.request_id,
                model=self.card.name,
                prompt_tokens=prompt_tokens,
                attempt=attempt,
            )
        ]
        for event in events[skip:]:
            if self.rate > 0:
                await asyncio.sleep(len(getattr(event, "token_ids", ())) / self.rate)
            else:
                await asyncio.sleep(0)  # a step boundary other tasks (and cancel checks) can use
            if isinstance(event, Usage):
                break  # Usage and Finish travel together in the last step
            yield [event]
        if fail:
            raise ScriptedFailure("scripted failure after partial output (scenario 'error')")
        yield [events[-2], events[-1]]

    def script(self, job: Job, scenario: str) -> tuple[list[AnyEvent], bool]:
        """The scenario's events after ``Start`` (ending with Usage, Finish) and whether it fails.

        ``max_tokens`` truncates the script; the result is a pure function of the job.
        """
        events, finish = _SCRIPTS[scenario](self, job)
        limit = job.max_tokens if job.max_tokens is not None else self.card.context_length
        kept: list[AnyEvent] = []
        used = 0
        for event in events:
            ids: list[int] = getattr(event, "token_ids", [])
            if used + len(ids) > limit:
                room = ids[: limit - used]
                finish = Finish(reason="max_tokens")
                if room and isinstance(event, TextDelta):
                    kept.append(TextDelta(text=self._decode(room), token_ids=room))
                elif room and isinstance(event, ReasoningDelta):
                    text = self._decode(room).removeprefix(THINK_OPEN)
                    kept.append(ReasoningDelta(text=text, token_ids=room))
                elif room:  # a half-written tool call stays in the parser: held tokens
                    finish = Finish(reason="max_tokens", token_ids=room)
                used = limit - len(finish.token_ids)
                break
            kept.append(event)
            used += len(ids)
        reasoning = sum(
            len(e.token_ids) for e in kept if isinstance(e, ReasoningDelta | ReasoningEnd)
        )
        usage = Usage(
            input_tokens=self.prompt_tokens(job),
            output_tokens=used + len(finish.token_ids),
            reasoning_tokens=reasoning,
        )
        return [*kept, usage, finish], scenario == "error"

    # -- scenario builders: (events without Start/Usage, the Finish) --------------------------

    def _text(self, text: str) -> list[AnyEvent]:
        return [TextDelta(text=p, token_ids=self.encode(p)) for p in _PIECE.findall(text)]

    def _end_turn(self) -> Finish:
        return Finish(reason="end_turn", token_ids=[self.eos_id])

    def _tool_call(
        self, job: Job, index: int, name: str, args: list[str], trailing: str = ""
    ) -> list[AnyEvent]:
        """One hermes-style call whose ids spell `<tool_call>{"name": ..., "arguments": ...}`."""
        digest = hashlib.sha256(f"{job.request_id}:{index}".encode()).hexdigest()[:24]
        head = self.encode(f'{TOOL_OPEN}\n{{"name": "{name}", "arguments": ')
        tail = self.encode(f"}}\n{TOOL_CLOSE}{trailing}")
        events: list[AnyEvent] = [
            ToolCallStart(index=index, call_id=f"call_{digest}", name=name, token_ids=head)
        ]
        events += [
            ToolCallArgsDelta(index=index, fragment=f, token_ids=self.encode(f)) for f in args
        ]
        events.append(ToolCallEnd(index=index, arguments="".join(args), token_ids=tail))
        return events


def _resume_point(events: list[AnyEvent], resume: list[int]) -> int:
    """Index of the first event not covered by ``resume`` (published batches are whole events)."""
    if not resume:
        return 0
    done: list[int] = []
    for i, event in enumerate(events):
        if done == resume:
            return i
        done.extend(getattr(event, "token_ids", ()))
        if len(done) > len(resume):
            break
    raise InvalidRequest("resume token ids do not match this request's script")


def _scenario_text(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    return b._text("Hello! This is a scripted reply from sluice's test double."), b._end_turn()


def _scenario_reasoning(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    body = _PIECE.findall("The user greets me. A short, friendly answer will do.")
    events: list[AnyEvent] = [
        ReasoningDelta(text=p, token_ids=b.encode((THINK_OPEN if i == 0 else "") + p))
        for i, p in enumerate(body)
    ]
    events.append(ReasoningEnd(token_ids=b.encode(THINK_CLOSE + "\n\n")))
    return [*events, *b._text("Hi there! How can I help?")], b._end_turn()


def _scenario_tool_call(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    name = job.tools[0].name if job.tools else "get_weather"
    events = b._tool_call(job, 0, name, ['{"city": ', '"Paris"}'])
    return events, Finish(reason="tool_use", token_ids=[b.eos_id])


def _scenario_parallel(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    name = job.tools[0].name if job.tools else "get_weather"
    events = b._text("Checking both cities.\n")
    events += b._tool_call(job, 0, name, ['{"city": "Paris"}'], trailing="\n")
    events += b._tool_call(job, 1, name, ['{"city": ', '"Oslo"}'])
    return events, Finish(reason="tool_use", token_ids=[b.eos_id])


def _scenario_parameterless(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    name = job.tools[0].name if job.tools else "get_time"
    return b._tool_call(job, 0, name, ["{}"]), Finish(reason="tool_use", token_ids=[b.eos_id])


def _scenario_stop_sequence(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    text = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
    stop = next((s for s in job.stop if s and s in text), ", 4")
    before = text[: text.index(stop)]
    finish = Finish(reason="stop_sequence", stop_sequence=stop, token_ids=b.encode(stop))
    return b._text(before), finish


def _scenario_error(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    return b._text("This answer will fail"), b._end_turn()


def _scenario_echo(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    last = next((m.text for m in reversed(job.messages) if m.role == "user"), "")
    return b._text(last or "(nothing to echo)"), b._end_turn()


def _scenario_long(b: ScriptedBackend, job: Job) -> tuple[list[AnyEvent], Finish]:
    return b._text(" ".join(f"w{i}" for i in range(LONG_WORDS))), b._end_turn()


_SCRIPTS: dict[str, Callable[[ScriptedBackend, Job], tuple[list[AnyEvent], Finish]]] = {
    "text": _scenario_text,
    "reasoning": _scenario_reasoning,
    "tool_call": _scenario_tool_call,
    "parallel_tool_calls": _scenario_parallel,
    "parameterless_tool_call": _scenario_parameterless,
    "stop_sequence": _scenario_stop_sequence,
    "error": _scenario_error,
    "echo": _scenario_echo,
    "long": _scenario_long,
}
