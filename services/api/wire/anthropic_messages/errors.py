"""Anthropic's error vocabulary: the HTTP envelope, and the in-band type of an ``Error`` event.

Owns ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's status-to-type table
(the anthropic SDK picks its exception class from the status), the ``error.type`` a failed
stream's ``event: error`` carries, and the exception a non-streaming request raises for a
terminal ``Error`` (with ``retry-after`` on overload, which Anthropic clients honour on 529).
"""

from __future__ import annotations

from services.api.wire import common
from shared.errors import ContextOverflow, ServiceError
from shared.events import Error, ErrorKind

__all__ = ["context_message", "error_body", "error_type", "service_error"]

_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

_TYPES_BY_KIND: dict[ErrorKind, str] = {
    "overloaded": "overloaded_error",
    "invalid_request": "invalid_request_error",
    "context_overflow": "invalid_request_error",
    "worker_lost": "api_error",
    "cancelled": "invalid_request_error",  # as the HTTP 499 renders: the client's doing
    "internal": "api_error",
}


def error_body(err: ServiceError) -> tuple[int, dict[str, object]]:
    """Map an error to Anthropic's status and ``{"type": "error", "error": {...}}`` body.

    Args:
        err: the error.

    Returns:
        ``(status, body)``; the SDK picks its exception class from the status.
    """
    status = err.http_status
    kind = _TYPES_BY_STATUS.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    message = context_message(err) if isinstance(err, ContextOverflow) else None
    return status, {"type": "error", "error": {"type": kind, "message": message or err.message}}


def context_message(err: ContextOverflow) -> str | None:
    """Anthropic's own sentence for a request that does not fit the context, when known.

    Claude Code reads the three numbers out of the first form and retries with a ``max_tokens``
    that fits; the second tells it the prompt alone is too long, so it compacts the
    conversation. Any other wording (OpenAI's, say) makes it give up on the first request.

    Args:
        err: the overflow, with the counts admission measured.

    Returns:
        The message, or None when the error carries no counts (the worker's KV budget).
    """
    prompt, wanted, limit = err.prompt_tokens, err.max_tokens, err.context_length
    if prompt is None or wanted is None or limit is None:
        return None
    if prompt > limit:
        return f"prompt is too long: {prompt} tokens > {limit} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {prompt} + {wanted} > {limit}, "
        "decrease input length or `max_tokens` and try again"
    )


def error_type(kind: ErrorKind) -> str:
    """Anthropic's ``error.type`` for an ``Error`` event's kind.

    Args:
        kind: the event's kind.

    Returns:
        ``overloaded_error``, ``invalid_request_error`` or ``api_error``.
    """
    return _TYPES_BY_KIND[kind]


def service_error(event: Error) -> ServiceError:
    """The exception a non-streaming request raises for a terminal ``Error`` event.

    The app renders it with Anthropic's envelope and status (400, 499, 500, 529; ``retry-after``
    on a retryable overload, see ``common.service_error``).

    Args:
        event: the terminal error.

    Returns:
        The matching ``ServiceError`` subclass instance.
    """
    return common.service_error(event)
