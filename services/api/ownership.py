"""Reading what is stored under a request id, for its owner only: one rule, one 404.

Every route that reads a stored request or response (retrieve, replay, the native event stream,
cancel, a stored Response and its ``previous_response_id`` history) loads it through
``load_owned``. A record that does not exist and one another API key created get the same
``NotFound``: a 403 would tell a caller that an id exists, so ids could be probed, and OpenAI's
API answers 404 to another organisation's response id too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.api.state import AppState
from shared import keys
from shared.codec import decode_job
from shared.errors import NotFound
from shared.jobs import Job

__all__ = ["REQUESTS", "RETRIEVABLE", "Stored", "load_owned"]

T = TypeVar("T", covariant=True)  # a Stored[Job] is a Stored[GenerateRequest]


@dataclass(frozen=True)
class Stored(Generic[T]):
    """One kind of record kept under a request id.

    Attributes:
        read: returns the record's owner id and the record, or None when there is none.
        missing: the error for an id the caller may not see (absent or another key's).
    """

    read: Callable[[AppState, str], Awaitable[tuple[str, T] | None]]
    missing: Callable[[str], NotFound]


async def load_owned(state: AppState, stored: Stored[T], rid: str, owner: str) -> T:
    """Load a stored record for the key that created it.

    Args:
        state: the app state.
        stored: which kind of record (``REQUESTS``, ``responses_store.RESPONSES``).
        rid: the request id.
        owner: the caller's owner id from ``authenticate``.

    Returns:
        The record.

    Raises:
        NotFound: no such record (or its retention expired), or another key created it.
    """
    found = await stored.read(state, rid)
    if found is None or found[0] != owner:
        raise stored.missing(rid)
    return found[1]


async def _read_request(state: AppState, rid: str) -> tuple[str, Job] | None:
    fields = await state.redis.hmget(keys.request(rid), ["owner", "job"])  # type: ignore[misc]
    stored_owner, payload = fields[0], fields[1]
    if payload is None:
        return None
    return (stored_owner or b"").decode(), decode_job(payload)


def _no_request(rid: str) -> NotFound:
    return NotFound(f"no request with id '{rid}'", param="id")


REQUESTS: Stored[Job] = Stored(read=_read_request, missing=_no_request)
"""The request hash (``sluice:request:{rid}``): the job as it was enqueued."""


async def _read_retrievable(state: AppState, rid: str) -> tuple[str, Job] | None:
    found = await _read_request(state, rid)
    return None if found is None or not found[1].store else found


RETRIEVABLE: Stored[Job] = Stored(read=_read_retrievable, missing=_no_request)
"""A request hash that may be retrieved as a finished answer: a ``store: false`` one is missing
(404, as OpenAI answers), though its event routes still resume it within the resume window."""
