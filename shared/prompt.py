"""Render a job's conversation through the model's chat template and tokenize it safely.

Used by the API (render + tokenize before enqueueing, Anthropic ``count_tokens``) and by a worker
for jobs that arrive without prompt ids. It owns three things:

* the canonical job → Hugging Face message dicts conversion (``tool_calls`` with
  ``function.arguments`` as an object, ``tool`` messages with ``tool_call_id``/``name``,
  ``reasoning_content`` for replayed reasoning, content as one string);
* the reasoning controls → template kwargs mapping (``enable_thinking``/``thinking`` off when the
  effort is ``none``, or when nobody will see the reasoning and the server default says not to
  think); the client's ``chat_template_kwargs`` always win;
* forge-proof tokenization: text a client supplied is encoded as text even when it spells an added
  token such as ``<|im_start|>`` or ``<think>``. The template is rendered a second time with each
  such string replaced by a unique sentinel; the plain render is split at the positions the
  sentinels occupy, template pieces are encoded with added-token matching and client pieces with
  a tokenizer that treats every added token as plain text. ``text`` stays the plain render.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import msgspec
import tokenizers

from shared.chat_template import TemplateError, render_chat_template, template_mentions
from shared.jobs import GenerateRequest, Message, ToolDef
from shared.model_card import ModelCard, ReasoningMarkers
from shared.prefill import cut_after, prefill_text

__all__ = [
    "MAX_NESTING",
    "NestingError",
    "PromptRenderer",
    "RenderedPrompt",
    "hf_messages",
    "hf_tools",
    "starts_in_reasoning",
    "template_kwargs",
]

# chat_template_kwargs keys that are render_chat_template's own parameters, not free variables.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Keys whose values we write ourselves (never client text), so they are never sentinel-ized.
_OWN_KEYS = frozenset({"role", "type"})
# The deepest nesting of objects and lists a render walks (a tool schema's). Real schemas stay
# within a few dozen; past this the walk would run out of Python's stack, so it is refused as
# the client's error instead of surfacing as a RecursionError (a 500 wherever nobody caught it).
MAX_NESTING = 256


class NestingError(TemplateError):
    """A tool schema nests deeper than a render can walk (the client's error)."""

    def __init__(self) -> None:
        super().__init__("a tool schema is nested too deeply")


class RenderedPrompt(msgspec.Struct, frozen=True):
    """A rendered, tokenized prompt."""

    text: str
    token_ids: list[int]
    starts_in_reasoning: bool


def starts_in_reasoning(prompt_token_ids: list[int], markers: ReasoningMarkers | None) -> bool:
    """Return True when the prompt ends inside an open reasoning block.

    That is the case when the last reasoning marker in the prompt is the open marker (a template
    that pre-opens ``<think>`` in the generation prompt, DeepSeek-R1 or Qwen3 style).
    """
    if markers is None:
        return False
    for token_id in reversed(prompt_token_ids):
        if token_id == markers.open_id:
            return True
        if token_id == markers.close_id:
            return False
    return False


def _arguments(raw: str) -> Any:
    # Templates expect an object (many apply ``tojson``); keep the text if it is not JSON.
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _hf_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    if message.role == "tool" and message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    return out


def hf_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Convert canonical messages into the dicts chat templates expect."""
    return [_hf_message(m) for m in messages]


def _hf_tool(tool: ToolDef) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def hf_tools(tools: list[ToolDef]) -> list[dict[str, Any]] | None:
    """Convert tool definitions into OpenAI-style function dicts (None when there are none)."""
    return [_hf_tool(t) for t in tools] or None


def template_kwargs(
    job: GenerateRequest, template: str, *, reasoning_when_hidden: bool = False
) -> dict[str, Any]:
    """The free template variables for a job: reasoning switches, then the client's kwargs.

    Thinking is switched off (``enable_thinking=False`` and ``thinking=False``, where the template
    reads them) when the effort is ``none`` or the budget is 0, or when the caller will not see
    reasoning, did not ask for any, and the server default ``reasoning_when_hidden`` is off.
    ``chat_template_kwargs`` are applied last, so an explicit client value always wins.
    """
    control = job.reasoning
    hidden_default_off = not control.visible and not control.explicit and not reasoning_when_hidden
    disable = control.effort == "none" or control.budget_tokens == 0 or hidden_default_off
    out: dict[str, Any] = {}
    if disable:
        for name in ("enable_thinking", "thinking"):
            if template_mentions(template, name):
                out[name] = False
    elif control.effort is not None and template_mentions(template, "reasoning_effort"):
        out["reasoning_effort"] = control.effort
    out.update(job.chat_template_kwargs)
    return out


def _no_prepend(node: Any) -> Any:
    """Switch off word-start prefixes (Metaspace ``▁``, ByteLevel space, ``Prepend``)."""
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "Prepend":
        return None
    if kind == "Metaspace":
        node = {**node, "prepend_scheme": "never"}
        if "add_prefix_space" in node:
            node["add_prefix_space"] = False
    if kind == "ByteLevel":
        node = {**node, "add_prefix_space": False}
    for key in ("pretokenizers", "normalizers"):
        if isinstance(node.get(key), list):
            parts = [_no_prepend(p) for p in node[key]]
            node = {**node, key: [p for p in parts if p is not None]}
    return node


def _derive(
    tokenizer: tokenizers.Tokenizer, *, text_only: bool, prepend: bool
) -> tokenizers.Tokenizer:
    """A copy of ``tokenizer`` for one kind of prompt piece.

    ``text_only``: never match an added token, so client text stays text. ``prepend=False``: the
    piece continues a prompt, so no word-start prefix is added (encoding a piece on its own
    would otherwise insert a SentencePiece ``▁`` the whole-text encoding does not have).
    """
    data = json.loads(tokenizer.to_str())
    if text_only:
        for added in data.get("added_tokens") or []:
            added["special"] = True  # encode_special_tokens only skips tokens marked special
    if not prepend:
        data["normalizer"] = _no_prepend(data.get("normalizer"))
        data["pre_tokenizer"] = _no_prepend(data.get("pre_tokenizer"))
    copy = tokenizers.Tokenizer.from_str(json.dumps(data))
    copy.encode_special_tokens = text_only
    return copy


class PromptRenderer:
    """Renders and tokenizes jobs for one model card.

    Args:
        card: The model card (template, tokenizer JSON, bos/eos, reasoning markers).
        tokenizer: A tokenizer built from ``card.tokenizer_json``; built here when None.
        reasoning_when_hidden: Server default: think even when the caller will not see it.
    """

    def __init__(
        self,
        card: ModelCard,
        tokenizer: tokenizers.Tokenizer | None = None,
        *,
        reasoning_when_hidden: bool = False,
    ) -> None:
        self.card = card
        self.tokenizer = tokenizer or tokenizers.Tokenizer.from_str(card.tokenizer_json)
        self.reasoning_when_hidden = reasoning_when_hidden
        self._derived: dict[tuple[bool, bool], tokenizers.Tokenizer] = {}
        added = self.tokenizer.get_added_tokens_decoder().values()
        contents = sorted({t.content for t in added if t.content}, key=len, reverse=True)
        # One alternation scanned once per client string; None when there is nothing to forge.
        self._added = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._bos_id = self.tokenizer.token_to_id(card.bos_token) if card.bos_token else None

    def render(self, job: GenerateRequest) -> RenderedPrompt:
        """Render the job's messages and tools, tokenize, and find the initial reasoning state.

        Raises:
            TemplateError: the template failed, client text spelling a control token could not
                be isolated from the template's own text.
            NestingError: a tool schema nests deeper than ``MAX_NESTING`` (or than the
                template's own walk of it can go).
        """
        try:
            return self._render(job)
        except RecursionError as exc:  # a template's recursive macro, on a schema within the cap
            raise NestingError from exc

    def _render(self, job: GenerateRequest) -> RenderedPrompt:
        messages = hf_messages(job.messages)
        tools = hf_tools(job.tools)
        kwargs = template_kwargs(
            job, self.card.chat_template, reasoning_when_hidden=self.reasoning_when_hidden
        )
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
        final = prefill_text(job)
        if final is not None:
            add_generation_prompt = False
            if not final:  # nothing to continue: an answer of its own, after the turns before
                messages, add_generation_prompt = messages[:-1], True
                final = None
        for key in _RESERVED:
            kwargs.pop(key, None)
        kwargs.setdefault("bos_token", self.card.bos_token)
        kwargs.setdefault("eos_token", self.card.eos_token)

        def render(msgs: list[dict[str, Any]], tls: list[dict[str, Any]] | None) -> str:
            text = render_chat_template(
                self.card.chat_template,
                msgs,
                tools=tls,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            return text if final is None else cut_after(text, str(msgs[-1]["content"]).strip())

        text = render(messages, tools)
        originals: list[str] = []
        nonce = uuid.uuid4().hex[:12]
        masked = self._mask({"m": messages, "t": tools}, originals, nonce)
        if originals:
            masked_text = render(masked["m"], masked["t"])
            ids = self._encode_isolated(text, masked_text, originals, nonce)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (
            self.card.add_bos_token
            and self._bos_id is not None
            and self.card.bos_token
            and not text.startswith(self.card.bos_token)
        ):
            ids = [self._bos_id, *ids]
        opened = starts_in_reasoning(ids, self.card.reasoning)
        return RenderedPrompt(text=text, token_ids=ids, starts_in_reasoning=opened)

    def count_tokens(self, job: GenerateRequest) -> int:
        """Number of prompt tokens the job renders to (Anthropic ``count_tokens``)."""
        return len(self.render(job).token_ids)

    def _encode(self, piece: str, *, text_only: bool, first: bool) -> list[int]:
        """Encode one piece of a prompt split at client text (see ``_derive``)."""
        if not piece:
            return []
        if not text_only and first:
            tokenizer = self.tokenizer
        else:
            key = (text_only, first)
            if key not in self._derived:
                self._derived[key] = _derive(self.tokenizer, text_only=text_only, prepend=first)
            tokenizer = self._derived[key]
        return tokenizer.encode(piece, add_special_tokens=False).ids

    def text_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: added tokens it spells are not matched."""
        return self._encode(text, text_only=True, first=True)

    def _mask(
        self, value: Any, originals: list[str], nonce: str, key: str = "", depth: int = 0
    ) -> Any:
        """Replace every client string that contains an added token's text with a sentinel."""
        if depth > MAX_NESTING:
            raise NestingError
        if isinstance(value, str):
            if key in _OWN_KEYS or self._added is None or not self._added.search(value):
                return value
            originals.append(value)
            return f"\u2063{nonce}{len(originals) - 1}\u2063"
        if isinstance(value, dict):
            # Keys are client text too (a tool schema's property names, argument names).
            return {
                self._mask(k, originals, nonce): self._mask(v, originals, nonce, k, depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self._mask(v, originals, nonce, key, depth + 1) for v in value]
        return value

    def _encode_isolated(
        self, text: str, masked: str, originals: list[str], nonce: str
    ) -> list[int]:
        """Encode ``text`` with each client string (located through ``masked``) as plain text."""
        parts = re.split(f"\u2063{nonce}(\\d+)\u2063", masked)
        ids: list[int] = []
        pos = 0
        for k, part in enumerate(parts):
            if k % 2 == 0:
                if not text.startswith(part, pos):
                    raise TemplateError("template renders client text it cannot isolate")
                ids += self._encode(part, text_only=False, first=pos == 0)
                pos += len(part)
                continue
            following = parts[k + 1]
            for candidate in _renderings(originals[int(part)]):
                end = pos + len(candidate)
                if text.startswith(candidate, pos) and text.startswith(following, end):
                    ids += self._encode(candidate, text_only=True, first=pos == 0)
                    pos = end
                    break
            else:
                raise TemplateError("template transforms client text it cannot isolate")
        if pos != len(text):
            raise TemplateError("template renders client text it cannot isolate")
        return ids


def _renderings(value: str) -> list[str]:
    """The forms a template commonly writes a string in: as is, trimmed, or JSON-escaped."""
    escaped = json.dumps(value, ensure_ascii=False)[1:-1]
    forms = [
        value,
        value.strip(),
        value.strip("\n"),
        value.lstrip("\n"),
        value.rstrip("\n"),
        value.lstrip(),
        value.rstrip(),
        escaped,
        json.dumps(value)[1:-1],
    ]
    return list(dict.fromkeys(forms))
