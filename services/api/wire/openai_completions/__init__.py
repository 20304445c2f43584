"""OpenAI legacy Completions (``/v1/completions``) on the wire.

``request`` parses a body into the job (raw text, no chat template), ``prompt`` tokenizes the
prompt (fill-in-the-middle with the model's FIM tokens), ``types`` holds the response Structs
and the ``Context``, ``projector`` streams events as chunks, ``render`` builds the
non-streaming body from the fold of the same events. Errors use OpenAI's envelope.
"""

from services.api.wire.openai_completions.projector import Projector, usage_chunk
from services.api.wire.openai_completions.prompt import (
    build_prompt,
    echo_ids,
    raw_ids,
    token_strings,
)
from services.api.wire.openai_completions.render import render, render_choices
from services.api.wire.openai_completions.request import ParsedCompletion, parse_request
from services.api.wire.openai_completions.types import Context, TextCompletion

__all__ = [
    "Context",
    "ParsedCompletion",
    "Projector",
    "TextCompletion",
    "build_prompt",
    "echo_ids",
    "parse_request",
    "raw_ids",
    "render",
    "render_choices",
    "token_strings",
    "usage_chunk",
]
