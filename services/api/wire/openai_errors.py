"""OpenAI's error vocabulary, which Chat Completions and Responses share.

Owns the ``{"error": {"message", "type", "param", "code", "retryable"}}`` envelope and the
status, ``type`` and ``code`` of each ``ServiceError``. ``retryable`` is sluice's addition, inside
``error`` because that object is what the openai SDK keeps as ``APIError.body`` (for HTTP errors
and in-band stream errors alike) and it ignores keys it does not know: a client reads
``exc.body["retryable"]``, others are unaffected. Every route outside ``/v1/messages`` and
``/api/`` answers errors in this envelope, and the Chat Completions and completions projectors
send it in-band when a stream fails after the headers. Anthropic's envelope lives beside its
format (``anthropic_messages.errors``).
"""

from __future__ import annotations

from shared.errors import (
    AuthenticationFailed,
    ContextOverflow,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    Overloaded,
    PermissionDenied,
    RateLimited,
    RequestTooLarge,
    ServiceError,
)

__all__ = ["error_body"]

# OpenAI (type, code) per error class; the code strings are the ones clients special-case
# (Codex retries on rate_limit_exceeded, compacts on context_length_exceeded).
_OPENAI: list[tuple[type[ServiceError], str, str | None]] = [
    (ContextOverflow, "invalid_request_error", "context_length_exceeded"),
    (InvalidRequest, "invalid_request_error", None),
    (AuthenticationFailed, "invalid_request_error", "invalid_api_key"),
    (PermissionDenied, "permission_error", "permission_denied"),
    (ModelNotFound, "invalid_request_error", "model_not_found"),
    (NotFound, "invalid_request_error", "not_found"),
    (RequestTooLarge, "invalid_request_error", "request_too_large"),
    (RateLimited, "rate_limit_error", "rate_limit_exceeded"),
    (Overloaded, "service_unavailable_error", "overloaded"),
]


def _kind(err: ServiceError, status: int) -> tuple[str, str | None]:
    for cls, kind, code in _OPENAI:
        if isinstance(err, cls):
            return kind, code
    return ("server_error" if status >= 500 else "invalid_request_error"), err.code


def error_body(err: ServiceError) -> tuple[int, dict[str, object]]:
    """Map an error to OpenAI's status and ``{"error": {...}}`` body.

    Args:
        err: the error.

    Returns:
        ``(status, body)``. ``Overloaded`` becomes 503: OpenAI has no 529 and its SDK retries 503.
    """
    status = 503 if isinstance(err, Overloaded) else err.http_status
    kind, code = _kind(err, status)
    error = {
        "message": err.message,
        "type": kind,
        "param": err.param,
        "code": code,
        "retryable": err.retryable,
    }
    return status, {"error": error}
