"""The per-sequence output decoder: generated token ids in, semantic events out.

One ``OutputDecoder`` per sequence composes the incremental detokenizer, the token-level
reasoning router, the streaming tool-call parser and the stop-sequence matcher. The engine calls
``feed`` once per generated token, checks ``stop_reason`` and ``forced_next_token()`` between
steps, and ends with ``finish(reason)``.

Token accounting (``ledger.TokenLedger``) keeps the stream invariant: every fed token id rides
on exactly one event, in order. Ids whose text is held back (a partial stop string, a matched
stop, EOS) ride on ``Finish``.

Answer text goes out only up to the end of a whole token's text (text released ahead of its
token waits in ``_unsent``), and a tool-call event carries every token fed so far. So what a
published prefix of the stream shows is exactly what its token ids produce: a continuation
worker calls ``resume(ids)`` with the lost worker's published ids and goes on without repeating
or losing text (call ids are a hash of request id and index, so they come out the same too).

Stop sequences apply to answer text only (never to reasoning or tool-call arguments), and tool
calls are parsed only when the job declares tools, ``tool_choice`` is not ``none`` and the model
card names a tool-call style (or the choice is forced: then the grammar writes a bare JSON call).
"""

from __future__ import annotations

import hashlib
from typing import Literal

import tokenizers

from services.worker.parsing.budget import reasoning_budget
from services.worker.parsing.detok import Detokenizer
from services.worker.parsing.ledger import TokenLedger
from services.worker.parsing.reasoning import ReasoningRouter
from services.worker.parsing.stops import StopMatcher
from services.worker.parsing.tool_calls import (
    Action,
    CallParser,
    Completed,
    Failed,
    Fragment,
    Started,
    Trailing,
)
from shared.events import (
    AnyEvent,
    Finish,
    FinishReason,
    ReasoningDelta,
    ReasoningEnd,
    TextDelta,
    TokenLogprob,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from shared.grammar import tool_markers
from shared.jobs import GenerateRequest
from shared.model_card import ModelCard

__all__ = ["OutputDecoder", "call_id"]

Mode = Literal["text", "reasoning", "calls"]


def call_id(request_id: str, index: int) -> str:
    """A tool call id that a resumed decoder reproduces: ``call_`` + hash(request id, index)."""
    digest = hashlib.sha256(f"{request_id}\x00{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


class OutputDecoder:
    """Turns one sequence's generated tokens into events.

    Args:
        tokenizer: The model's tokenizer.
        card: The model card (eos ids, reasoning and tool markers).
        job: The job (stop strings, tools, tool choice, reasoning control, ignore_eos).
        prompt_tokens: Prompt length, for ``Usage``.
        cached_tokens: Prompt tokens reused from a cache, for ``Usage``.
        starts_in_reasoning: The prompt left a reasoning block open.
    """

    def __init__(
        self,
        *,
        tokenizer: tokenizers.Tokenizer,
        card: ModelCard,
        job: GenerateRequest,
        prompt_tokens: int,
        cached_tokens: int = 0,
        starts_in_reasoning: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.card = card
        self.job = job
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.stop_reason: FinishReason | None = None
        self.stop_sequence: str | None = None
        self.output_tokens = 0
        self.reasoning_tokens = 0
        self.calls_completed = 0
        self._eos = set() if job.ignore_eos else set(card.eos_token_ids)
        # A raw-text job (legacy completions) keeps reasoning markers in its text: no router.
        markers = None if job.raw_text else card.reasoning
        self._router = ReasoningRouter(
            markers, inside=starts_in_reasoning, budget=reasoning_budget(job.reasoning)
        )
        use_tools = bool(job.tools) and job.tool_choice.mode != "none" and not job.raw_text
        self._tools = tool_markers(card.tools, job) if use_tools else None
        named = job.tool_choice.name if job.tool_choice.mode == "named" else None
        self._tool_names = {named} if named else {t.name for t in job.tools}
        self._ledger = TokenLedger()
        self._detok = Detokenizer(tokenizer)
        self._mode: Mode = "reasoning" if self._router.inside else "text"
        self._stops = StopMatcher(job.stop)
        self._text_base = 0  # ledger.pos where the current stop matcher's text begins
        self._unsent = ""  # answer text released by the stop matcher, waiting for its token
        self._answer_started = False  # visible non-space text emitted (llama3 JSON detection)
        self._lead = ""  # held leading answer text while it may still open a llama3 JSON call
        self._parser: CallParser | None = None
        self._call_base = 0  # ledger.pos where the call parser's text begins
        self._call_open = False  # a ToolCallStart was emitted without its ToolCallEnd
        self._await_marker: Completed | None = None  # hermes: End waits for </tool_call>
        self._marker_text: str | None = None  # text of the token that opened the call region

    # ------------------------------------------------------------------ public interface

    def feed(self, token_id: int, logprob: TokenLogprob | None = None) -> list[AnyEvent]:
        """Consume one generated token; return the delta events it released."""
        self.output_tokens += 1
        if self.stop_reason is not None:
            self._ledger.hold(token_id)  # fed past the end: carried, never shown
            return []
        if token_id in self._eos:
            self._ledger.hold(token_id)
            self.stop_reason = "end_turn"
            return []
        if self._mode == "reasoning":
            return self._feed_reasoning(token_id, logprob)
        out: list[AnyEvent] = []
        tools = self._tools
        if self._router.is_open(token_id) and self._mode == "text":
            out += self._end_text()
            self._switch("reasoning")
            self._router.inside = True
            self.reasoning_tokens += 1
            self._ledger.add(token_id, logprob)
            return out
        if tools is not None and token_id == tools.open_id and self._mode == "text":
            out += self._end_text()
            self._ledger.add(token_id, logprob)
            self._begin_calls(marker=tools.open)
            return out
        if tools is not None and tools.style == "hermes" and self._mode == "calls":
            if token_id == tools.close_id:
                return self._close_hermes(token_id, logprob)
            if token_id == tools.open_id and self._await_marker is not None:
                # A new <tool_call> where </tool_call> was due: end the finished call first.
                done, self._await_marker = self._await_marker, None
                out += self._end_call(done, self._ledger.pos)
                self._ledger.add(token_id, logprob)
                self._begin_calls(marker=tools.open)
                return out
        piece = self._ledger.add(token_id, logprob, self._detok.step(token_id))
        return out + self._route(piece)

    def forced_next_token(self) -> int | None:
        """The reasoning close marker once the budget is spent inside reasoning, else None."""
        if self.stop_reason is not None:
            return None
        return self._router.forced_close()

    def resume(self, token_ids: list[int]) -> None:
        """Rebuild the state after ``token_ids``, which a lost worker already published.

        Feeds them and discards their events, then treats all they produced as published: held
        text (a possible stop-string prefix, text waiting for its token) is dropped unemitted and
        the queued ids are forgotten. Parser state (inside reasoning, inside a call, indexes) is
        kept, and so are incomplete UTF-8 bytes: their character belongs to a later token.
        """
        for token_id in token_ids:
            self.feed(token_id)
        self._ledger.forget()
        self._unsent = ""
        if self._mode == "text":
            self._stops.released = len(self._stops.text)

    def finish(self, reason: FinishReason) -> list[AnyEvent]:
        """Flush held text, close open blocks, then ``Usage`` and ``Finish``."""
        out = self._route(self._flush())
        if self._mode == "reasoning":
            out.append(ReasoningEnd(token_ids=self._ledger.take(self._ledger.pos)[0]))
        elif self._mode == "calls":
            out += self._finish_calls()
        else:
            out += self._end_text()
        if self._unsent:  # text before a stop string that shares a token with it: ids on Finish
            out.append(TextDelta(text=self._unsent))
            self._unsent = ""
        if reason == "end_turn" and self.calls_completed and not self._call_open:
            reason = "tool_use"
        out.append(
            Usage(
                input_tokens=self.prompt_tokens,
                output_tokens=self.output_tokens,
                cached_tokens=self.cached_tokens,
                reasoning_tokens=self.reasoning_tokens,
            )
        )
        ids = self._ledger.drain()
        stop = self.stop_sequence if reason == "stop_sequence" else None
        out.append(Finish(reason=reason, stop_sequence=stop, token_ids=ids))
        return out

    # ------------------------------------------------------------------ token bookkeeping

    def _flush(self) -> str:
        """Text the detokenizer still holds (end of a segment); its tokens are already queued."""
        return self._ledger.advance(self._detok.flush())

    def _switch(self, mode: Mode) -> None:
        self._mode = mode
        self._detok = Detokenizer(self.tokenizer)
        if mode == "text":
            self._stops = StopMatcher(self.job.stop)
            self._text_base = self._ledger.pos

    # ------------------------------------------------------------------ reasoning

    def _feed_reasoning(self, token_id: int, logprob: TokenLogprob | None) -> list[AnyEvent]:
        self.reasoning_tokens += 1
        if self._router.is_close(token_id):
            out = self._reasoning_delta(self._flush())
            self._ledger.add(token_id, logprob)
            out.append(ReasoningEnd(token_ids=self._ledger.take(self._ledger.pos)[0]))
            self._router.inside = False
            self._switch("text")
            return out
        self._router.count()  # a <tool_call> in here is reasoning too
        piece = self._ledger.add(token_id, logprob, self._detok.step(token_id))
        return self._reasoning_delta(piece)

    def _reasoning_delta(self, piece: str) -> list[AnyEvent]:
        if not piece:
            return []
        return [ReasoningDelta(text=piece, token_ids=self._ledger.take(self._ledger.pos)[0])]

    # ------------------------------------------------------------------ answer text

    def _route(self, piece: str) -> list[AnyEvent]:
        """Send decoded text to the current text or call channel."""
        if not piece:
            return []
        if self._mode == "reasoning":
            return self._reasoning_delta(piece)
        if self._mode == "calls":
            return self._call_actions(self._parser_feed(piece))
        tools = self._tools
        if tools is not None and tools.style == "llama3_json" and not self._answer_started:
            self._lead += piece
            stripped = self._lead.lstrip()
            if not stripped:
                return []
            lead, self._lead = self._lead, ""
            if stripped[0] == "{":
                self._begin_calls(base=self._ledger.pos - len(lead))
                return self._call_actions(self._parser_feed(lead))
            piece = lead
        return self._text(self._stops.push(piece))

    def _text(self, released: str) -> list[AnyEvent]:
        if self._stops.matched is not None and self.stop_reason is None:
            self.stop_reason = "stop_sequence"
            self.stop_sequence = self._stops.matched
        if released.strip():
            self._answer_started = True
        self._unsent += released
        if not self._unsent:
            return []
        end = self._text_base + self._stops.released  # absolute end of the released text
        begin = end - len(self._unsent)
        # Up to a queued token's end, or text whose tokens already rode on an earlier event
        # (a tool call's closing token that also holds the start of trailing prose).
        cut = max(self._ledger.boundary(end) or 0, min(end, self._ledger.taken_upto))
        if cut <= begin:
            return []  # no token's text is complete yet: it rides on a later delta
        text, self._unsent = self._unsent[: cut - begin], self._unsent[cut - begin :]
        ids, logprobs = self._ledger.take(cut)
        return [TextDelta(text=text, token_ids=ids, logprobs=logprobs or None)]

    def _end_text(self) -> list[AnyEvent]:
        """Release everything the text channel holds (a marker or the end interrupts it)."""
        if self._mode != "text":
            return []
        out = self._route(self._flush())
        if self._lead:
            lead, self._lead = self._lead, ""
            out += self._text(self._stops.push(lead))
        return out + self._text(self._stops.flush())

    # ------------------------------------------------------------------ tool calls

    def _begin_calls(self, *, marker: str | None = None, base: int | None = None) -> None:
        self._switch("calls")
        self._parser = CallParser(self._tool_names)
        self._call_base = self._ledger.pos if base is None else base
        self._marker_text = marker  # shown again if the region turns out not to be a call

    def _parser_feed(self, piece: str) -> list[Action]:
        assert self._parser is not None
        return self._parser.feed(piece)

    def _call_actions(self, actions: list[Action]) -> list[AnyEvent]:
        out: list[AnyEvent] = []
        index = self.calls_completed
        for action in actions:
            if isinstance(action, Started):
                ids = self._ledger.take(self._ledger.pos)[0]
                rid = self.job.request_id
                out.append(
                    ToolCallStart(
                        index=index, call_id=call_id(rid, index), name=action.name, token_ids=ids
                    )
                )
                self._call_open = True
            elif isinstance(action, Fragment):
                ids = self._ledger.take(self._ledger.pos)[0]
                out.append(ToolCallArgsDelta(index=index, fragment=action.text, token_ids=ids))
            elif isinstance(action, Completed):
                if self._tools is not None and self._tools.style == "hermes":
                    self._await_marker = action  # the close marker rides on the End
                else:
                    out += self._end_call(action, self._ledger.pos)
                    index = self.calls_completed
            elif isinstance(action, Trailing) and self._await_marker is not None:
                continue  # junk before </tool_call>: its tokens ride on the End
            else:
                out += self._degrade(action)
        assert self._parser is not None
        if self._parser.failed and self._call_open and self.stop_reason is None:
            self.stop_reason = "end_turn"  # broken JSON after the call was announced: end it
        return out

    def _end_call(self, done: Completed, upto: int) -> list[AnyEvent]:
        index = self.calls_completed
        ids = self._ledger.take(upto)[0]
        self.calls_completed += 1
        self._call_open = False
        if not self.job.parallel_tool_calls and self.stop_reason is None:
            self.stop_reason = "tool_use"
        return [ToolCallEnd(index=index, arguments=done.arguments, token_ids=ids)]

    def _degrade(self, action: Failed | Trailing) -> list[AnyEvent]:
        """Show text that turned out not to be a call, and continue as plain text."""
        raw = action.raw if isinstance(action, Failed) else action.text
        if isinstance(action, Failed) and self._marker_text:
            raw = self._marker_text + raw  # the marker token's text was swallowed: give it back
        self._switch("text")
        self._answer_started = True
        self._text_base = self._ledger.pos - len(raw)
        return self._text(self._stops.push(raw))

    def _close_hermes(self, token_id: int, logprob: TokenLogprob | None) -> list[AnyEvent]:
        out = self._route(self._flush())
        self._ledger.add(token_id, logprob)
        done, self._await_marker = self._await_marker, None
        if done is not None:
            out += self._end_call(done, self._ledger.pos)
            self._switch("text")
        elif self._mode == "calls":
            out += self._finish_calls()
            if self._call_open:
                self.stop_reason = self.stop_reason or "end_turn"
            else:
                self._switch("text")
        return out

    def _finish_calls(self) -> list[AnyEvent]:
        """End of the call channel: complete what can be completed, give back held text."""
        assert self._parser is not None
        out = self._call_actions(self._parser.finish())
        done, self._await_marker = self._await_marker, None
        if done is not None:
            out += self._end_call(done, self._ledger.pos)
        return out
