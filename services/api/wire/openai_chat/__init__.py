"""OpenAI Chat Completions (``/v1/chat/completions``) on the wire.

``request`` parses a body into the job, ``types`` holds the response Structs and the
``Context``, ``projector`` streams events as chunks, ``render`` builds the non-streaming body
from the fold of the same events. Errors use OpenAI's envelope (``wire.openai_errors``).
"""

from services.api.wire.openai_chat.projector import Projector, usage_chunk
from services.api.wire.openai_chat.render import render, render_choices
from services.api.wire.openai_chat.request import ParsedChat, parse_request
from services.api.wire.openai_chat.types import ChatCompletion, Context

__all__ = [
    "ChatCompletion",
    "Context",
    "ParsedChat",
    "Projector",
    "parse_request",
    "render",
    "render_choices",
    "usage_chunk",
]
