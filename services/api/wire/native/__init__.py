"""sluice's native format (``/v1/requests``) on the wire: the canonical job in, typed events out.

``request`` checks a body as a ``GenerateRequest``; ``projector`` streams each event as an SSE
frame of its own JSON. Errors use OpenAI's envelope (``wire.openai_errors``).
"""

from services.api.wire.native.projector import NativeProjector
from services.api.wire.native.request import parse_job

__all__ = ["NativeProjector", "parse_job"]
