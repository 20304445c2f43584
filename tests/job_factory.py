"""Tokenized jobs for tests that hand a job to a backend or a worker without the API.

The API renders and tokenizes every request before it enqueues it (``services.api.submit``); a
test that skips the API does the same here with ``shared.prompt``, against the card (and
tokenizer) of the backend that will run the job.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers import Tokenizer

from shared.events import AnyEvent
from shared.jobs import GenerateRequest, Job
from shared.model_card import ModelCard
from shared.prompt import PromptRenderer
from tests.invariants import check_stream

__all__ = ["as_job", "run", "tokenize"]


class _HasCard(Protocol):
    card: ModelCard


def tokenize(request: GenerateRequest, card: ModelCard, tokenizer: Tokenizer | None = None) -> Job:
    """Render ``request`` through ``card``'s chat template and tokenize it, as the API does.

    A ``Job`` is returned as it is: its prompt is already tokenized.
    """
    if isinstance(request, Job):
        return request
    rendered = PromptRenderer(card, tokenizer).render(request)
    return Job.of(request, prompt_token_ids=list(rendered.token_ids), prompt_text=rendered.text)


def as_job(request: GenerateRequest, backend: _HasCard) -> Job:
    """``request`` tokenized for ``backend`` (its card; a loaded model's own tokenizer if any)."""
    loaded = getattr(backend, "loaded", None)
    return tokenize(request, backend.card, getattr(loaded, "tokenizer", None))


async def run(backend: Any, request: GenerateRequest) -> list[AnyEvent]:
    """Every event of ``request`` on ``backend`` (a ``TorchBackend``), the stream checked."""
    events: list[AnyEvent] = []
    async for batch in backend.generate(as_job(request, backend), [], 1):
        events.extend(batch)
    check_stream(events)
    return events
