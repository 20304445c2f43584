"""Error envelopes per wire family, and the app's exception handlers.

Every error a client sees leaves through here: ``ServiceError`` subclasses raised anywhere in a
request, FastAPI's validation errors (never its 422 ``detail`` body), Starlette's 404/405, and
unhandled exceptions. Paths under ``/v1/messages`` get Anthropic's envelope, everything else
OpenAI's (wire-formats.md §2.10, §4.10, §7.5). Mid-stream errors are not handled here; after the
headers are sent the projector's in-band error frame is the only channel.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

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

__all__ = [
    "anthropic_error_body",
    "error_response",
    "install_error_handlers",
    "openai_error_body",
]

logger = logging.getLogger(__name__)

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

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def _openai_kind(err: ServiceError, status: int) -> tuple[str, str | None]:
    for cls, kind, code in _OPENAI:
        if isinstance(err, cls):
            return kind, code
    return ("server_error" if status >= 500 else "invalid_request_error"), err.code


def openai_error_body(err: ServiceError) -> tuple[int, dict[str, object]]:
    """Map an error to OpenAI's status and ``{"error": {...}}`` body.

    Args:
        err: the error.

    Returns:
        ``(status, body)``. ``Overloaded`` becomes 503: OpenAI has no 529 and its SDK retries 503.
    """
    status = 503 if isinstance(err, Overloaded) else err.http_status
    kind, code = _openai_kind(err, status)
    body: dict[str, object] = {
        "error": {"message": err.message, "type": kind, "param": err.param, "code": code}
    }
    return status, body


def anthropic_error_body(err: ServiceError) -> tuple[int, dict[str, object]]:
    """Map an error to Anthropic's status and ``{"type": "error", "error": {...}}`` body.

    Args:
        err: the error.

    Returns:
        ``(status, body)``; the SDK picks its exception class from the status.
    """
    status = err.http_status
    kind = _ANTHROPIC_TYPES.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return status, {"type": "error", "error": {"type": kind, "message": err.message}}


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def error_response(request: Request, err: ServiceError) -> JSONResponse:
    """Render ``err`` in the envelope the request's path calls for.

    Args:
        request: the failing request (its path picks the format).
        err: the error.

    Returns:
        A JSON response with ``Retry-After`` when the error carries ``retry_after``.
    """
    status, body = (anthropic_error_body if _is_anthropic(request) else openai_error_body)(err)
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return JSONResponse(body, status_code=status, headers=headers)


async def _on_service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    if exc.http_status >= 500:
        logger.warning("request failed: %s (%s)", exc.message, exc.code)
    return error_response(request, exc)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    message = str(first.get("msg", "invalid request"))
    param = ".".join(loc) or None
    if param:
        message = f"{message} (at {param})"
    return error_response(request, InvalidRequest(message, param=param))


class _HTTPStatusError(ServiceError):
    """Starlette's HTTPException (unknown route, wrong method) under our envelope."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = status
        self.code = "not_found" if status == 404 else "invalid_request"


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        err: ServiceError = NotFound(f"no route for {request.method} {request.url.path}")
    else:
        err = _HTTPStatusError(exc.status_code, str(exc.detail))
    response = error_response(request, err)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _on_client_disconnect(request: Request, exc: Exception) -> Response:
    # The client left before a non-streaming answer was ready; nobody reads this response.
    return Response(status_code=499)


async def _on_unhandled(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request, ServiceError("internal server error"))


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every failure into the right JSON error envelope.

    Args:
        app: the application.
    """
    app.add_exception_handler(ServiceError, _on_service_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(ClientDisconnect, _on_client_disconnect)
    app.add_exception_handler(Exception, _on_unhandled)
