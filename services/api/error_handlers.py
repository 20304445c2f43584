"""The app's exception handlers: every failure leaves in its wire family's error envelope.

Every error a client sees before the headers leaves through here: ``ServiceError`` subclasses
raised anywhere in a request, FastAPI's validation errors (never its 422 ``detail`` body),
Starlette's 404/405, and unhandled exceptions. A path under a wire format's prefix gets that
format's envelope (``services.api.formats``: Anthropic's under ``/v1/messages``, Ollama's under
``/api``), everything else OpenAI's (``wire.openai_errors``), since each SDK only parses its own.
Mid-stream errors are not handled here; after the headers are sent the projector's in-band
error frame is the only channel.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
    ResponseError,
    TimeoutError as RedisTimeout,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.api.formats import owner_of
from services.api.wire import openai_errors
from services.redis_oom import OOM_MESSAGE, is_oom
from shared.errors import InvalidRequest, NotFound, ServiceError, Unavailable

__all__ = ["error_response", "install_error_handlers"]

logger = logging.getLogger(__name__)


def error_response(request: Request, err: ServiceError) -> JSONResponse:
    """Render ``err`` in the envelope the request's path calls for.

    Args:
        request: the failing request (its path picks the format).
        err: the error.

    Returns:
        A JSON response with ``Retry-After`` when the error carries ``retry_after``.
    """
    owner = owner_of(request.url.path)
    status, body = (owner.envelope if owner else openai_errors.error_body)(err)
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


async def _on_redis_down(request: Request, exc: Exception) -> Response:
    # Redis restarting, failing over or loading its data: a client that retries in a moment
    # gets through, so this is a 503 with Retry-After and not an internal error.
    logger.warning("Redis unavailable on %s %s: %s", request.method, request.url.path, exc)
    err = Unavailable("the event store is unavailable; retry shortly", retry_after=1)
    return error_response(request, err)


async def _on_redis_refused(request: Request, exc: Exception) -> Response:
    # A Redis at maxmemory refuses writes until memory is freed: like an outage, a client that
    # retries in a moment gets through. Handled here (not left to ``Exception``'s handler), so
    # the connection stays usable and Redis's text, which names a script hash, is not sent.
    if not is_oom(exc):
        return await _on_unhandled(request, exc)
    logger.warning("Redis out of memory on %s %s: %s", request.method, request.url.path, exc)
    return error_response(request, Unavailable(OOM_MESSAGE, retry_after=1))


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
    app.add_exception_handler(RedisConnectionError, _on_redis_down)  # BusyLoading included
    app.add_exception_handler(RedisTimeout, _on_redis_down)
    app.add_exception_handler(ResponseError, _on_redis_refused)  # OutOfMemoryError included
    app.add_exception_handler(Exception, _on_unhandled)
