"""Error envelopes: every ServiceError maps to each family's status, type and code."""

from __future__ import annotations

import pytest

from services.api.wire.anthropic_messages import error_body as anthropic_error_body
from services.api.wire.openai_errors import error_body as openai_error_body
from shared.errors import (
    AuthenticationFailed,
    Cancelled,
    ContextOverflow,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    NoWorker,
    Overloaded,
    PermissionDenied,
    ProtocolError,
    RateLimited,
    RequestTooLarge,
    ServiceError,
    Unavailable,
    WorkerLost,
)

CASES = [
    (
        InvalidRequest("bad", param="x"),
        400,
        "invalid_request_error",
        None,
        400,
        "invalid_request_error",
    ),
    (
        ContextOverflow("long"),
        400,
        "invalid_request_error",
        "context_length_exceeded",
        400,
        "invalid_request_error",
    ),
    (
        AuthenticationFailed("who"),
        401,
        "invalid_request_error",
        "invalid_api_key",
        401,
        "authentication_error",
    ),
    (PermissionDenied("no"), 403, "permission_error", "permission_denied", 403, "permission_error"),
    (NotFound("gone"), 404, "invalid_request_error", "not_found", 404, "not_found_error"),
    (ModelNotFound("m"), 404, "invalid_request_error", "model_not_found", 404, "not_found_error"),
    (
        RequestTooLarge("big"),
        413,
        "invalid_request_error",
        "request_too_large",
        413,
        "request_too_large",
    ),
    (
        RateLimited("slow", retry_after=2),
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
        429,
        "rate_limit_error",
    ),
    (Overloaded("busy"), 503, "service_unavailable_error", "overloaded", 529, "overloaded_error"),
    (NoWorker("none"), 503, "server_error", "no_worker", 503, "overloaded_error"),
    (Unavailable("down"), 503, "server_error", "unavailable", 503, "overloaded_error"),
    (WorkerLost("dead"), 500, "server_error", "worker_lost", 500, "api_error"),
    (ProtocolError("bytes"), 500, "server_error", "protocol", 500, "api_error"),
    (ServiceError("boom"), 500, "server_error", "internal", 500, "api_error"),
    # the client's doing, not a server failure: 499 with the 4xx fallback type in both families
    (Cancelled("gone"), 499, "invalid_request_error", "cancelled", 499, "invalid_request_error"),
]
# The classes whose errors may succeed when sent again (the rest say retryable: false).
RETRYABLE = (RateLimited, Overloaded, NoWorker, Unavailable)


@pytest.mark.parametrize(("err", "oa_status", "oa_type", "oa_code", "an_status", "an_type"), CASES)
def test_envelopes(
    err: ServiceError,
    oa_status: int,
    oa_type: str,
    oa_code: str | None,
    an_status: int,
    an_type: str,
) -> None:
    status, body = openai_error_body(err)
    assert status == oa_status
    retryable = isinstance(err, RETRYABLE)
    assert body == {
        "error": {
            "message": err.message,
            "type": oa_type,
            "param": err.param,
            "code": oa_code,
            "retryable": retryable,
        }
    }
    status, body = anthropic_error_body(err)
    assert status == an_status
    assert body == {"type": "error", "error": {"type": an_type, "message": err.message}}


def test_every_error_class_is_covered() -> None:
    import shared.errors as errors

    classes = {getattr(errors, name) for name in errors.__all__}
    assert classes == {type(case[0]) for case in CASES}
