"""Responses input items → conversation turns, for requests and for stored responses.

Owns the item Structs (message, function_call, function_call_output, reasoning) and the fold of
an item list into ``Message`` turns: one assistant turn gathers a turn's reasoning, text and
calls; tool results become ``tool`` turns named after their call. The same code replays a stored
response's output for ``previous_response_id``, so both paths build identical conversations.
Foreign ``encrypted_content`` on reasoning items is accepted and ignored. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

import msgspec

from services.api.wire.common import JsonObject, error_location
from services.api.wire.openai_responses.tools import CUSTOM_INPUT, exposed_name
from services.api.wire.reasoning_tokens import ReasoningSigner
from shared.errors import InvalidRequest
from shared.jobs import Message, TextPart, ToolCall

__all__ = ["JsonObject", "items_to_messages", "validation_error"]


class _Part(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None


class _MessageIn(msgspec.Struct, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]


class _FunctionCallIn(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class _CustomCallIn(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class _ToolSearchCallIn(msgspec.Struct, kw_only=True):
    call_id: str | None = None
    id: str | None = None
    arguments: object = None


class _ToolSearchOutputIn(msgspec.Struct, kw_only=True):
    call_id: str | None = None
    id: str | None = None
    tools: list[JsonObject] = []


class _FunctionCallOutputIn(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[_Part]


class _ReasoningIn(msgspec.Struct, kw_only=True):
    summary: list[_Part] = []
    content: list[_Part] | None = None
    encrypted_content: str | None = None  # sluice's restores the text; another server's: ignored


def validation_error(exc: msgspec.ValidationError, prefix: str = "") -> InvalidRequest:
    """Turn msgspec's ``... - at `$.a[0].b``` message into a client message plus ``param``.

    Args:
        exc: the validation error.
        prefix: the request path of the object that was validated (e.g. ``input[2]``).

    Returns:
        The ``InvalidRequest`` to raise.
    """
    message, location = error_location(str(exc))
    # msgspec spells "some dict value" as [...]; the dict itself is the useful param.
    path = (location or "").replace("[...]", "")
    param = f"{prefix}{'.' if prefix and path and not path.startswith('[') else ''}{path}"
    return InvalidRequest(f"{message} (at '{param}')" if param else message, param=param or None)


def _part_text(part: _Part, where: str) -> str:
    if part.type in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        return part.text or ""
    if part.type == "refusal":
        return part.refusal or ""
    raise InvalidRequest(
        f"Content part type {part.type!r} is not supported: this server serves text-only models",
        param=where,
    )


def _content_text(content: str | list[_Part], where: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(_part_text(p, f"{where}[{j}]") for j, p in enumerate(content))


class _Conversation:
    """Folds items into turns: one assistant message per turn gathers reasoning, text, calls."""

    def __init__(self, prior: Sequence[Message], signer: ReasoningSigner | None) -> None:
        self.signer = signer
        self.messages: list[Message] = list(prior)
        self.call_names = {c.id: c.name for m in prior for c in m.tool_calls}
        self._text: list[str] = []
        self._calls: list[ToolCall] = []
        self._reasoning: list[str] = []

    def reasoning(self, text: str) -> None:
        if self._text or self._calls:
            self.flush()
        if text:
            self._reasoning.append(text)

    def assistant_text(self, text: str) -> None:
        if self._calls:
            self.flush()
        self._text.append(text)

    def call(self, call: ToolCall) -> None:
        self.call_names[call.id] = call.name
        self._calls.append(call)

    def append(self, message: Message) -> None:
        self.flush()
        self.messages.append(message)

    def flush(self) -> None:
        # Reasoning with no answer after it (a cut-off turn) renders as nothing: drop it.
        if self._text or self._calls:
            text = "".join(self._text)
            self.messages.append(
                Message(
                    role="assistant",
                    content=[TextPart(text=text)] if text else [],
                    tool_calls=self._calls,
                    reasoning="".join(self._reasoning) or None,
                )
            )
        self._text, self._calls, self._reasoning = [], [], []


def items_to_messages(
    items: Sequence[JsonObject],
    prior: Sequence[Message] = (),
    *,
    param: str = "input",
    signer: ReasoningSigner | None = None,
) -> list[Message]:
    """Map Responses items (input items, or a stored response's output) onto turns.

    Args:
        items: message, function_call, function_call_output and reasoning items.
        prior: turns that come before these items (their tool calls name later outputs).
        param: the request field the items came from, for error messages.
        signer: verifies sluice's own ``encrypted_content`` and restores the reasoning in it.

    Returns:
        ``prior`` followed by the items' turns.

    Raises:
        InvalidRequest: an unknown item type or a malformed item.
    """
    conv = _Conversation(prior, signer)
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        try:
            _add_item(conv, kind, item, where)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, where) from exc
    conv.flush()
    return conv.messages


def _add_item(conv: _Conversation, kind: object, item: JsonObject, where: str) -> None:
    if kind == "message":
        msg = msgspec.convert(item, _MessageIn)
        text = _content_text(msg.content, f"{where}.content")
        if msg.role == "assistant":
            conv.assistant_text(text)
        else:
            role: Literal["user", "system"] = "user" if msg.role == "user" else "system"
            conv.append(Message(role=role, content=[TextPart(text=text)]))
    elif kind == "function_call":
        fc = msgspec.convert(item, _FunctionCallIn)
        name = exposed_name(fc.name, fc.namespace)
        conv.call(ToolCall(id=fc.call_id, name=name, arguments=fc.arguments))
    elif kind == "custom_tool_call":
        # Replayed the way the model was offered it: a function of one ``input`` string.
        cc = msgspec.convert(item, _CustomCallIn)
        arguments = json.dumps({CUSTOM_INPUT: cc.input}, ensure_ascii=False)
        name = exposed_name(cc.name, cc.namespace)
        conv.call(ToolCall(id=cc.call_id, name=name, arguments=arguments))
    elif kind == "tool_search_call":
        ts = msgspec.convert(item, _ToolSearchCallIn)
        arguments = json.dumps(ts.arguments if ts.arguments is not None else {})
        conv.call(ToolCall(id=ts.call_id or ts.id or "", name="tool_search", arguments=arguments))
    elif kind == "tool_search_output":
        found = msgspec.convert(item, _ToolSearchOutputIn)
        call_id = found.call_id or found.id or ""
        text = json.dumps(found.tools, ensure_ascii=False)
        conv.append(
            Message(
                role="tool", content=[TextPart(text=text)], tool_call_id=call_id, name="tool_search"
            )
        )
    elif kind in ("function_call_output", "custom_tool_call_output"):
        out = msgspec.convert(item, _FunctionCallOutputIn)
        text = _content_text(out.output, f"{where}.output")
        conv.append(
            Message(
                role="tool",
                content=[TextPart(text=text)],
                tool_call_id=out.call_id,
                name=conv.call_names.get(out.call_id),
            )
        )
    elif kind == "reasoning":
        rs = msgspec.convert(item, _ReasoningIn)
        # Raw reasoning text is what the model wrote; a summary is the next best thing. An
        # encrypted blob we cannot read (another server's) is ignored, never an error.
        parts = rs.content if rs.content else rs.summary
        text = "".join(_part_text(p, f"{where}.content") for p in parts)
        if conv.signer is not None:
            # Codex (store: false) sends back only the summary and this token.
            text = conv.signer.check(rs.encrypted_content, text, f"{where}.encrypted_content")
        conv.reasoning(text)
    else:
        raise InvalidRequest(
            f"Input item type {kind!r} is not supported; use message, function_call, "
            "function_call_output, custom_tool_call(_output), tool_search_call/output or "
            "reasoning items",
            param=f"{where}.type",
        )
