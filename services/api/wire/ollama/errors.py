"""Ollama's error envelope: ``{"error": "<message>"}`` with the HTTP status.

Ollama's clients read only ``error`` and the status (the Python client raises
``ResponseError(error, status_code)``), so the envelope carries no type or code. Overload is a
503, as Ollama answers when its queue is full: there is no 529 in its vocabulary.
"""

from __future__ import annotations

from shared.errors import Overloaded, ServiceError

__all__ = ["error_body"]


def error_body(err: ServiceError) -> tuple[int, dict[str, object]]:
    """Map an error to Ollama's status and body.

    Args:
        err: the error.

    Returns:
        ``(status, {"error": message})``.
    """
    status = 503 if isinstance(err, Overloaded) else err.http_status
    return status, {"error": err.message}
