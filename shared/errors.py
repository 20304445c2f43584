"""The one error hierarchy, rooted at ``ServiceError``.

::

    ServiceError                      500 internal
    ├── InvalidRequest                400 invalid_request
    │   └── ContextOverflow           400 context_overflow
    ├── AuthenticationFailed          401 authentication
    ├── PermissionDenied              403 permission
    ├── NotFound                      404 not_found
    │   └── ModelNotFound             404 model_not_found
    ├── RequestTooLarge               413 request_too_large
    ├── Cancelled                     499 cancelled         (cancelled before any worker started it)
    ├── RateLimited                   429 rate_limited      (retry_after)
    ├── Overloaded                    529 overloaded        (retry_after)
    ├── NoWorker                      503 no_worker
    ├── Unavailable                   503 unavailable       (retry_after: Redis unreachable)
    ├── WorkerLost                    500 worker_lost
    └── ProtocolError                 500 protocol          (undecodable event or job)

Each wire format maps ``code``/``http_status`` to its own error envelope. ``retryable`` says
whether the same request may succeed if sent again (OpenAI's error bodies carry it); an error
made from a terminal ``Error`` event takes the event's own flag instead of its class's.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationFailed",
    "Cancelled",
    "ContextOverflow",
    "InvalidRequest",
    "ModelNotFound",
    "NoWorker",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "ProtocolError",
    "RateLimited",
    "RequestTooLarge",
    "ServiceError",
    "Unavailable",
    "WorkerLost",
]


class ServiceError(Exception):
    """Base of every error sluice raises on purpose."""

    code = "internal"
    http_status = 500
    retryable = False

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        """Build an error with a client-facing message and optional offending parameter."""
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


class InvalidRequest(ServiceError):
    """The request is malformed or asks for something unsupported."""

    code = "invalid_request"
    http_status = 400


class ContextOverflow(InvalidRequest):
    """The prompt (plus requested output) does not fit the model's context.

    Admission fills in the numbers (``prompt_tokens``, ``max_tokens``, ``context_length``) so
    each wire format can word the error as its vendor does: clients parse those sentences
    (Claude Code retries with a smaller ``max_tokens`` read out of Anthropic's wording).
    """

    code = "context_overflow"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        context_length: int | None = None,
    ) -> None:
        """Build the error; the token counts are None when the raiser does not know them."""
        super().__init__(message, param=param, retry_after=retry_after)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class AuthenticationFailed(ServiceError):
    """Missing or unknown API key."""

    code = "authentication"
    http_status = 401


class PermissionDenied(ServiceError):
    """The key may not access this resource (e.g. another key's request)."""

    code = "permission"
    http_status = 403


class NotFound(ServiceError):
    """No such resource."""

    code = "not_found"
    http_status = 404


class ModelNotFound(NotFound):
    """No worker has published this model."""

    code = "model_not_found"


class RequestTooLarge(ServiceError):
    """The request body exceeds the configured limit."""

    code = "request_too_large"
    http_status = 413


class Cancelled(ServiceError):
    """The request was cancelled before any worker started it: nothing was generated.

    499 is the status proxies use for a request its client closed (nginx's): a client's fault,
    not the server's, so SDKs do not retry it and monitoring does not count it as a failure.
    """

    code = "cancelled"
    http_status = 499


class RateLimited(ServiceError):
    """The model's queue is full; retry after ``retry_after`` seconds."""

    code = "rate_limited"
    http_status = 429
    retryable = True


class Overloaded(ServiceError):
    """The service is temporarily overloaded."""

    code = "overloaded"
    http_status = 529
    retryable = True


class NoWorker(ServiceError):
    """The model is known but no live worker serves it."""

    code = "no_worker"
    http_status = 503
    retryable = True


class Unavailable(ServiceError):
    """The event store (Redis) cannot be reached, or lost a request's log; retry shortly."""

    code = "unavailable"
    http_status = 503
    retryable = True


class WorkerLost(ServiceError):
    """Workers died generating this request more often than allowed."""

    code = "worker_lost"


class ProtocolError(ServiceError):
    """Bytes on the bus do not decode as the contract says."""

    code = "protocol"
