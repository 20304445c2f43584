"""The boundary between the bus side of a worker and whatever produces events.

A backend knows nothing about Redis: it turns a job into event batches. The torch engine and
the scripted backend both implement it; ``services.worker.job_function`` drives it and publishes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from shared.events import AnyEvent
from shared.jobs import Job
from shared.model_card import ModelCard

__all__ = ["Backend"]


class Backend(Protocol):
    """A producer of inference events for one model.

    ``generate`` yields lists of events (what one decode step produced for this sequence, so the
    publisher can pipeline them in one round trip). It yields ``Start`` first and ends with
    ``Usage`` then a terminal ``Finish``; it may raise instead, and the caller turns that into an
    ``Error``. Closing the iterator early (``aclose()``) is cancellation: the backend frees the
    sequence's slot before ``aclose`` returns, and the caller publishes ``Finish(cancelled)``.

    ``resume_token_ids`` are tokens a lost worker already published for this request: the backend
    continues after them (re-feeding them to its parsers without re-emitting events) and stamps
    ``Start.attempt`` with ``attempt``.
    """

    card: ModelCard
    max_batch: int

    async def start(self) -> None:
        """Start background machinery (e.g. the decode loop thread)."""

    async def stop(self) -> None:
        """Stop background machinery; in-flight iterators end with an exception."""

    def generate(
        self, job: Job, resume_token_ids: list[int], attempt: int
    ) -> AsyncIterator[list[AnyEvent]]:
        """Generate the job's events in step-sized batches."""
        ...
