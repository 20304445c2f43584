"""Anthropic Messages (``/v1/messages``) on the wire.

``request`` parses a body (its Structs in ``request_types``) into the job, ``types`` holds the
response Structs and the ``Context``, ``projector`` streams events as ``event:``-named frames,
``render`` builds the non-streaming message from the fold of the same events, ``errors``
holds Anthropic's error envelope and error types, and ``fields`` names what was accepted
without effect.
"""

from services.api.wire.anthropic_messages.errors import error_body, service_error
from services.api.wire.anthropic_messages.fields import ignored_fields
from services.api.wire.anthropic_messages.projector import PING, Projector
from services.api.wire.anthropic_messages.render import render, tool_use_id
from services.api.wire.anthropic_messages.request import (
    build_job,
    ignored_tools,
    parse_count_tokens_request,
    parse_request,
)
from services.api.wire.anthropic_messages.request_types import MessagesRequest
from services.api.wire.anthropic_messages.thinking import restore_thinking
from services.api.wire.anthropic_messages.types import Context, Message

__all__ = [
    "PING",
    "Context",
    "Message",
    "MessagesRequest",
    "Projector",
    "build_job",
    "error_body",
    "ignored_fields",
    "ignored_tools",
    "parse_count_tokens_request",
    "parse_request",
    "render",
    "restore_thinking",
    "service_error",
    "tool_use_id",
]
