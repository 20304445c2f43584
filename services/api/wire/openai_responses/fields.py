"""Which top-level Responses fields are refused, and which are accepted without effect.

``parse_request`` refuses a few (a stored ``prompt`` template sluice cannot resolve would
answer a different question; ``priority`` and ``timeout`` as in every format); the route names
the rest of the undeclared fields (``prompt_cache_options``, ``moderation``, ``image``,
``context_management``, ...) and the ones ``ResponsesRequest`` declares only to echo them in
the ``x-sluice-ignored-fields`` header.
"""

from __future__ import annotations

from services.api.wire.extra_fields import extra_fields
from services.api.wire.openai_responses.request import ResponsesRequest

__all__ = ["ignored_fields"]

# Declared so the response can echo them; they change nothing sluice does.
_ECHOED_ONLY = ("prompt_cache_key", "prompt_cache_retention", "safety_identifier", "service_tier")


def ignored_fields(body: bytes, req: ResponsesRequest) -> list[str]:
    """The fields of a parsed request sluice did not act on.

    Args:
        body: the raw body ``req`` was parsed from.
        req: the parsed request.

    Returns:
        The echo-only fields that were set, then the undeclared ones in body order.
    """
    echoed = [f for f in _ECHOED_ONLY if getattr(req, f) is not None]
    return echoed + extra_fields(body, ResponsesRequest)
