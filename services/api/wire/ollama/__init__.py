"""Ollama's API (``/api/chat``, ``/api/generate`` and the model endpoints) on the wire.

``request`` parses a body (``options`` in ``options``) into the job, ``types`` holds the response
Structs and the ``Context``, ``projector`` streams events as NDJSON lines, ``render`` builds the
non-streaming body from the fold of the same events, ``models`` the bodies of ``/api/tags``,
``/api/show``, ``/api/ps`` and ``/api/version`` from model cards, and ``errors`` Ollama's error
envelope.
"""

from services.api.wire.ollama.errors import error_body
from services.api.wire.ollama.models import (
    VERSION,
    ps_body,
    show_body,
    tags_body,
)
from services.api.wire.ollama.projector import Projector, Skip
from services.api.wire.ollama.render import render, timestamp
from services.api.wire.ollama.request import Parsed, parse_chat, parse_generate
from services.api.wire.ollama.types import Context, Timing

__all__ = [
    "VERSION",
    "Context",
    "Parsed",
    "Projector",
    "Skip",
    "Timing",
    "error_body",
    "parse_chat",
    "parse_generate",
    "ps_body",
    "render",
    "show_body",
    "tags_body",
    "timestamp",
]
