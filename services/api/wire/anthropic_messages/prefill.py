"""A final assistant turn: the start of the answer, which the model continues (a prefill).

Anthropic's Messages API continues a conversation whose last turn is the assistant's from where
that turn ends: ``{"role": "assistant", "content": "{"}`` makes the answer a JSON object's rest,
and the response holds only what follows the prefill. Its rules, kept here: the prefill cannot
end with whitespace, it is not combined with extended thinking, and it is text (a tool call
cannot be continued). An empty final assistant turn is no prefill: the answer starts afresh.
"""

from __future__ import annotations

from services.api.wire.anthropic_messages.request_types import MessagesRequest, TextBlock
from shared.errors import InvalidRequest

__all__ = ["prefilled"]


def prefilled(req: MessagesRequest) -> bool:
    """Whether the answer continues the request's final assistant turn.

    Raises:
        InvalidRequest: the turn ends with whitespace, holds a block other than text, or
            thinking is on.
    """
    if not req.messages or req.messages[-1].role != "assistant":
        return False
    at = f"messages[{len(req.messages) - 1}].content"
    content = req.messages[-1].content
    blocks = [TextBlock(text=content)] if isinstance(content, str) else content
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise InvalidRequest(
                f"{at}[{j}]: a final assistant turn is continued as the answer, so it can hold "
                f"text blocks only, not {block.__struct_config__.tag!r}",
                param=f"{at}[{j}]",
            )
        texts.append(block.text)
    if not "".join(texts).strip():
        return False
    if texts[-1] != texts[-1].rstrip():
        raise InvalidRequest(
            "messages: final assistant content cannot end with trailing whitespace", param=at
        )
    if req.thinking is not None and req.thinking.type in ("enabled", "adaptive"):
        raise InvalidRequest(
            "messages: a final assistant turn (a prefill) cannot be continued with thinking "
            "enabled; send the turn without thinking, or end the conversation with a user turn",
            param=at,
        )
    return True
