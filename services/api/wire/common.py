"""Pieces the three wire formats share, on the request side and for terminal errors.

Owns what is the same rule in every format: the JSON object alias, the reasoning-effort
vocabulary and its validation, reading the offending path out of a msgspec validation message,
decoding a body into a request Struct with a client error (never FastAPI's 422) for bad JSON,
range checks on sampling knobs, and which exception a terminal ``Error`` event becomes when
nothing has been sent yet (``service_error``, the one mapping every format's non-streaming path
raises). Each format keeps its own Structs, messages, defaults and error envelope.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from shared.errors import (
    Cancelled,
    ContextOverflow,
    InvalidRequest,
    Overloaded,
    ServiceError,
    WorkerLost,
)
from shared.events import Error, ErrorKind
from shared.jobs import ReasoningEffort

__all__ = [
    "EFFORTS",
    "IGNORED_TOOLS_HEADER",
    "JsonObject",
    "WireInt",
    "check_range",
    "decode_body",
    "error_location",
    "reasoning_effort",
    "service_error",
]

JsonObject = dict[str, object]
# A count or limit a client sends: the job travels as msgpack, which holds 64 bits, so a larger
# number is the client's 400 here rather than the encoder's 500. msgspec bounds only int64; a
# seed, which may use all 64 bits unsigned, is left to ``submit``'s check.
WireInt = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
T = TypeVar("T")

# Tools a client declared that sluice cannot run (hosted/server tools, Chat's custom tools) are
# accepted, left out of the prompt and named in this response header, comma-separated.
IGNORED_TOOLS_HEADER = "x-sluice-ignored-tools"

# Newer SDKs know efforts the job vocabulary does not; clamp them to the strongest we have.
EFFORTS: dict[str, ReasoningEffort] = {
    "none": "none",
    "minimal": "minimal",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}

_EXCEPTIONS: dict[ErrorKind, type[ServiceError]] = {
    "invalid_request": InvalidRequest,
    "context_overflow": ContextOverflow,
    "overloaded": Overloaded,
    "worker_lost": WorkerLost,
    # Cancelled before any worker started it (the worker's answer to a raised cancel flag): the
    # client's doing, so a 4xx (499) and never the 500 a server failure is.
    "cancelled": Cancelled,
    "internal": ServiceError,
}

# msgspec reports "<what> - at `$.a[0].b`"; the path becomes the error's ``param``.
_LOCATION = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def error_location(message: str) -> tuple[str, str | None]:
    """Split a msgspec validation message into what went wrong and where.

    Args:
        message: ``str(msgspec.ValidationError)``, e.g. ``Expected `int` - at `$.n```.

    Returns:
        The message without its location, and the path after ``$.`` (``""`` for the root), or
        None when the message names no location.
    """
    match = _LOCATION.search(message)
    if match is None:
        return message, None
    return message[: match.start()], match["path"]


def decode_body(
    decoder: msgspec.json.Decoder[T],
    body: bytes,
    invalid: Callable[[msgspec.ValidationError], InvalidRequest],
) -> T:
    """Decode a request body, turning every decoding failure into ``InvalidRequest``.

    Args:
        decoder: the format's request decoder.
        body: the raw HTTP body.
        invalid: builds the format's error for a body that is JSON of the wrong shape.

    Returns:
        The decoded request.

    Raises:
        InvalidRequest: the body is not JSON, or not the request's shape.
    """
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise invalid(exc) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except UNDECODABLE as exc:
        raise undecodable(exc) from exc


# What msgspec raises, besides its own errors, for a body no client should send: invalid UTF-8
# inside a string, and nesting deeper than its recursion limit.
UNDECODABLE = (UnicodeDecodeError, RecursionError)


def undecodable(exc: Exception) -> InvalidRequest:
    """The 400 for a body in ``UNDECODABLE``'s sense (invalid UTF-8, absurd nesting).

    Args:
        exc: what the decoder raised.

    Returns:
        The error to raise.
    """
    if isinstance(exc, UnicodeDecodeError):
        return InvalidRequest(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}")
    return InvalidRequest("request body is nested too deeply")


def reasoning_effort(effort: str | None, param: str) -> ReasoningEffort | None:
    """Validate a requested reasoning effort and map it onto the job's vocabulary.

    Args:
        effort: the effort the client asked for, if any.
        param: where it sits in the request, for the error.

    Returns:
        The job's effort, or None when none was asked for.

    Raises:
        InvalidRequest: an effort no SDK knows.
    """
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise InvalidRequest(f"{param} must be one of {', '.join(EFFORTS)}", param=param)
    return EFFORTS[effort]


def check_range(value: float | None, low: float, high: float, param: str) -> None:
    """Reject a number outside ``[low, high]`` (None means "not given" and passes).

    Args:
        value: the requested value.
        low: the smallest allowed value.
        high: the largest allowed value.
        param: the field name, for the error.

    Raises:
        InvalidRequest: the value is out of range.
    """
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"{param} must be between {low} and {high}", param=param)


def service_error(error: Error) -> ServiceError:
    """The exception a terminal ``Error`` event becomes when no byte has been sent yet.

    The app's exception handlers render it with each format's own envelope and status. A
    retryable overload (the start timeout: no worker started the request in time; Redis out of
    memory) advertises ``Retry-After: 1`` in every format: OpenAI's 503 as Anthropic's 529, whose
    SDKs both honour the header.

    Args:
        error: the stream's terminal error.

    Returns:
        The matching ``ServiceError`` subclass instance (not raised), carrying the event's
        ``retryable``.
    """
    retry_after = 1.0 if error.kind == "overloaded" and error.retryable else None
    exc = _EXCEPTIONS[error.kind](error.message, retry_after=retry_after)
    exc.retryable = error.retryable  # the worker knows better than the error's class
    return exc
