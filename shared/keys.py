"""Every Redis key sluice uses, spelled in one place.

Per-request keys put the request id in a hash tag (``{rid}``), so one request's keys land in the
same Redis Cluster slot and can be touched in one pipeline or script.
"""

from __future__ import annotations

__all__ = [
    "PREFIX",
    "affinity_blocks",
    "affinity_holders",
    "affinity_preference",
    "cancel",
    "events",
    "failovers",
    "hub_wake",
    "inflight",
    "lease",
    "model_card",
    "models",
    "owner_secret",
    "queue",
    "reasoning_secret",
    "request",
    "response",
    "worker",
    "workers",
]

PREFIX = "sluice"


def events(rid: str) -> str:
    """The request's event log (a stream)."""
    return f"{PREFIX}:events:{{{rid}}}"


def request(rid: str) -> str:
    """The request hash: owner, model, created, origin, job payload."""
    return f"{PREFIX}:request:{{{rid}}}"


def cancel(rid: str) -> str:
    """Cancel flag the worker checks between decode steps."""
    return f"{PREFIX}:cancel:{{{rid}}}"


def lease(rid: str) -> str:
    """ "I am generating this": holds the worker id, short TTL, refreshed while generating."""
    return f"{PREFIX}:lease:{{{rid}}}"


def response(rid: str) -> str:
    """A stored Responses-API response object (JSON), for GET and previous_response_id."""
    return f"{PREFIX}:response:{{{rid}}}"


def worker(wid: str) -> str:
    """A worker's heartbeat hash (TTL)."""
    return f"{PREFIX}:worker:{wid}"


def workers() -> str:
    """Sorted set of worker ids scored by last heartbeat (ms), for discovery without SCAN."""
    return f"{PREFIX}:workers"


def model_card(model: str) -> str:
    """The model card a worker publishes for the API (tokenizer, template, limits, markers)."""
    return f"{PREFIX}:model:{model}"


def models() -> str:
    """Set of model names that have a published card."""
    return f"{PREFIX}:models"


def queue(model: str) -> str:
    """The arq queue (sorted set) for one model."""
    return f"{PREFIX}:queue:{model}"


def affinity_holders(model: str) -> str:
    """Hash of the workers that publish the prefixes they hold for a model's queue: worker id to
    ``"<free slots> <expiry, Redis ms> <reserved> <running>"`` (``services/queue/affinity.py``)."""
    return f"{PREFIX}:affinity:{model}"


def affinity_blocks(wid: str) -> str:
    """Set of the KV block hashes (``shared.prefix``) a worker's prefix cache holds (TTL)."""
    return f"{PREFIX}:affinity-blocks:{wid}"


def affinity_preference(job_id: str) -> str:
    """A queued job's preferred worker: ``"<worker id> <deadline, Redis ms> <blocks held>"``."""
    return f"{PREFIX}:affinity-job:{job_id}"


def inflight(model: str) -> str:
    """Sorted set of request ids being generated for a model, scored by enqueue time (ms).

    Workers sweep it to find requests whose lease expired without a terminal event.
    """
    return f"{PREFIX}:inflight:{model}"


def hub_wake(hub_id: str) -> str:
    """An API process's private wake stream: an XADD here interrupts its blocked multi-XREAD."""
    return f"{PREFIX}:hub:{hub_id}"


def failovers() -> str:
    """Recent failovers (a capped list of JSON records, newest first) for ``sluice status``."""
    return f"{PREFIX}:failovers"


def reasoning_secret() -> str:
    """String: the generated secret of reasoning tokens (when none is configured)."""
    return f"{PREFIX}:secret:reasoning"


def owner_secret() -> str:
    """String: the generated HMAC key of stored owner ids (when none is configured)."""
    return f"{PREFIX}:secret:owner"
