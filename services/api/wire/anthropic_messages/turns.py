"""Anthropic Messages turns → the job's canonical ``Message`` list.

The system prompt first, then each turn: an assistant turn's text, thinking and ``tool_use``
blocks become one assistant message with its tool calls and reasoning; a user turn's
``tool_result`` blocks become ``tool`` messages in block order with the text around them kept
as user messages. Consecutive turns of one role merge, as the Anthropic API combines them.
Misplaced blocks raise ``InvalidRequest`` naming the block.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from services.api.wire.anthropic_messages.request_types import (
    ContentBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from shared.errors import InvalidRequest
from shared.jobs import Message, TextPart, ToolCall

__all__ = ["messages"]


def messages(req: MessagesRequest) -> list[Message]:
    """The request's system prompt and turns as the job's messages, in order."""
    out: list[Message] = []
    if isinstance(req.system, str):
        if req.system:
            out.append(Message(role="system", content=[TextPart(text=req.system)]))
    elif req.system:
        out.append(Message(role="system", content=_joined([b.text for b in req.system])))
    tool_names: dict[str, str] = {}
    for i, turn in enumerate(req.messages):
        blocks: list[ContentBlock] = (
            [TextBlock(text=turn.content)] if isinstance(turn.content, str) else turn.content
        )
        if turn.role == "assistant":
            converted = [_assistant_turn(blocks, i, tool_names)]
        else:
            converted = _user_turn(turn.role, blocks, i, tool_names)
        for message in converted:
            _append_merged(out, message)
    return out


def _joined(texts: list[str]) -> list[TextPart]:
    # Templates see a message's parts concatenated; separate the blocks the way vLLM flattens
    # content parts, so "<system-reminder>…" and the user's words do not run together.
    return [TextPart(text="\n".join(texts))] if texts else []


def _assistant_turn(blocks: list[ContentBlock], turn: int, tool_names: dict[str, str]) -> Message:
    content: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        match block:
            case TextBlock():
                content.append(block.text)
            case ThinkingBlock():
                reasoning.append(block.thinking)
            case RedactedThinkingBlock():
                pass  # another provider's encrypted reasoning: nothing a local model can read
            case ToolUseBlock():
                tool_names[block.id] = block.name
                arguments = msgspec.json.encode(block.input).decode()
                calls.append(ToolCall(id=block.id, name=block.name, arguments=arguments))
            case ToolResultBlock():
                raise InvalidRequest(
                    f"messages[{turn}].content[{j}]: tool_result blocks belong in a user turn",
                    param=f"messages[{turn}].content[{j}]",
                )
    return Message(
        role="assistant",
        content=_joined(content),
        tool_calls=calls,
        reasoning="".join(reasoning) if reasoning else None,
    )


def _user_turn(
    role: Literal["user", "system"],
    blocks: list[ContentBlock],
    turn: int,
    tool_names: dict[str, str],
) -> list[Message]:
    # Tool results become "tool" messages in block order, text around them stays a user (or
    # system) message, so a chat template sees assistant(tool_calls) → tool → user.
    out: list[Message] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        match block:
            case TextBlock():
                text.append(block.text)
            case ThinkingBlock() | RedactedThinkingBlock():
                pass  # only meaningful in assistant turns; harmless elsewhere
            case ToolResultBlock() if role == "user":
                if text:
                    out.append(Message(role=role, content=_joined(text)))
                    text = []
                out.append(_tool_result(block, tool_names))
            case ToolUseBlock() | ToolResultBlock():
                raise InvalidRequest(
                    f"messages[{turn}].content[{j}]: {block.__struct_config__.tag} blocks "
                    f"are not allowed in a {role} turn",
                    param=f"messages[{turn}].content[{j}]",
                )
    if text or not out:
        out.append(Message(role=role, content=_joined(text)))
    return out


def _tool_result(block: ToolResultBlock, tool_names: dict[str, str]) -> Message:
    if block.content is None:
        parts: list[TextPart] = []
    elif isinstance(block.content, str):
        parts = [TextPart(text=block.content)]
    else:
        parts = _joined([b.text for b in block.content])
    return Message(
        role="tool",
        content=parts,
        tool_call_id=block.tool_use_id,
        # compacted histories may drop the matching tool_use; the name is only a template hint
        name=tool_names.get(block.tool_use_id),
        is_error=block.is_error,
    )


def _append_merged(out: list[Message], message: Message) -> None:
    # The Anthropic API combines consecutive turns of one role; chat templates that insist on
    # alternating roles would otherwise raise on perfectly valid Anthropic requests.
    last = out[-1] if out else None
    if last is None or last.role != message.role or message.role not in ("user", "assistant"):
        out.append(message)
        return
    reasoning = [r for r in (last.reasoning, message.reasoning) if r is not None]
    out[-1] = Message(
        role=message.role,
        content=_joined([m.text for m in (last, message) if m.content]),
        tool_calls=[*last.tool_calls, *message.tool_calls],
        reasoning="".join(reasoning) if reasoning else None,
    )
