"""Thinking blocks sent back by a client: sluice's own are verified and restored.

A ``thinking`` block sluice produced carries a signature (``wire.reasoning_tokens``) that holds
its text. Sent back unchanged, or with its text omitted (``display: "omitted"``), it is
restored to exactly what the model thought; sent back edited, it is a 400, as Anthropic answers
an edited block. Empty signatures and other providers' signatures are accepted as they are.
Pure: the signer is passed in.
"""

from __future__ import annotations

import msgspec

from services.api.wire.anthropic_messages.request_types import (
    InputMessage,
    MessagesRequest,
    ThinkingBlock,
)
from services.api.wire.reasoning_tokens import ReasoningSigner
from shared.errors import InvalidRequest

__all__ = ["restore_thinking"]


def restore_thinking(req: MessagesRequest, signer: ReasoningSigner) -> MessagesRequest:
    """The request with every sluice-signed thinking block checked and its text restored.

    Args:
        req: the parsed request.
        signer: the deployment's signer.

    Returns:
        The same request, thinking blocks replaced by their signed text.

    Raises:
        InvalidRequest: a sluice signature that does not verify, or a block whose text was
            edited after it was signed.
    """
    messages: list[InputMessage] = []
    for i, message in enumerate(req.messages):
        if message.role != "assistant" or isinstance(message.content, str):
            messages.append(message)
            continue
        blocks = list(message.content)
        for j, block in enumerate(blocks):
            if isinstance(block, ThinkingBlock) and block.signature:
                where = f"messages.{i}.content.{j}"
                try:
                    text = signer.check(block.signature, block.thinking, where)
                except InvalidRequest as exc:  # Anthropic's own wording for both failures
                    raise InvalidRequest(
                        f"{where}: Invalid `signature` in `thinking` block", param=where
                    ) from exc
                blocks[j] = msgspec.structs.replace(block, thinking=text)
        messages.append(msgspec.structs.replace(message, content=blocks))
    return msgspec.structs.replace(req, messages=messages)
