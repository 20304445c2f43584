"""Which parts of a Messages request sluice accepted without acting on them.

Named in the ``x-sluice-ignored-fields`` response header (``wire.extra_fields``): the top-level
fields ``MessagesRequest`` does not declare (``context_management``, ``container``,
``service_tier``, ``mcp_servers``, ... of the newest SDK; what would be refused already was, in
``parse_request``), and ``thinking.display`` when it asks for ``"updates"``, which sluice
serves as ``"summarized"``.
"""

from __future__ import annotations

from services.api.wire.anthropic_messages.request_types import MessagesRequest
from services.api.wire.extra_fields import extra_fields

__all__ = ["ignored_fields"]


def ignored_fields(body: bytes, req: MessagesRequest) -> list[str]:
    """The fields of a parsed request sluice did not act on, in body order.

    Args:
        body: the raw body ``req`` was parsed from.
        req: the parsed request.

    Returns:
        Their names (a nested one dotted), for the response header.
    """
    fields = extra_fields(body, MessagesRequest)
    if req.thinking is not None and req.thinking.display == "updates":
        fields.append("thinking.display")
    return fields
