"""Newline-delimited JSON framing (Ollama's streams): one frame's JSON and a newline.

The streaming pipeline frames a projector's output this way when the projector says
``ndjson = True``. A line carries no id and there are no keepalives: NDJSON has no comment
syntax, and Ollama's clients ``json.loads`` every line they read, an empty one included.
"""

from __future__ import annotations

from services.api.wire.sse import Frame

__all__ = ["HEADERS", "MEDIA_TYPE", "encode"]

MEDIA_TYPE = "application/x-ndjson"

# As for SSE: a proxy that buffers the body would deliver the whole stream at once.
HEADERS: dict[str, str] = {
    "Content-Type": MEDIA_TYPE,
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def encode(frame: Frame, entry_id: str | None = None) -> bytes:
    """One line: the frame's data (one-line JSON) and ``\\n``; ``entry_id`` is not sent.

    Args:
        frame: the frame (its ``event`` and ``id`` are ignored).
        entry_id: accepted for the SSE encoder's signature; NDJSON lines carry no id.

    Returns:
        The line.
    """
    data = frame.data
    return (data.encode() if isinstance(data, str) else data) + b"\n"
