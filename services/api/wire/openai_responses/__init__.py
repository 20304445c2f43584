"""OpenAI Responses (``/v1/responses``) on the wire.

``request`` parses a body into the job and the ``Response`` skeleton it echoes, ``items`` folds
input items (and a stored response's output) into conversation turns, ``types`` holds the
response object, its items, its stream events and the ``Context``, ``projector`` streams events,
and ``render`` builds the ``Response`` from the fold of the same events. Errors use OpenAI's
envelope (``wire.openai_errors``); ``fields`` names what was accepted without effect.
"""

from services.api.wire.openai_responses.fields import ignored_fields
from services.api.wire.openai_responses.input_list import input_items, page
from services.api.wire.openai_responses.items import items_to_messages
from services.api.wire.openai_responses.projector import Projector
from services.api.wire.openai_responses.render import entry_seconds, render
from services.api.wire.openai_responses.request import (
    build_job,
    input_messages,
    parse_request,
    skeleton,
    tool_set,
)
from services.api.wire.openai_responses.tools import IGNORED_TOOLS_HEADER
from services.api.wire.openai_responses.types import Context, Response

__all__ = [
    "IGNORED_TOOLS_HEADER",
    "Context",
    "Projector",
    "Response",
    "build_job",
    "entry_seconds",
    "ignored_fields",
    "input_items",
    "input_messages",
    "items_to_messages",
    "page",
    "parse_request",
    "render",
    "skeleton",
    "tool_set",
]
