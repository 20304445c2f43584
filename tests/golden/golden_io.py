"""What every golden transcript test does: project events to SSE bytes, compare with the file.

One place for the projection (feed every event, then ``close``, then SSE-encode) and for the
golden-file rule (``SLUICE_UPDATE_GOLDEN=1`` rewrites the file; otherwise the bytes must match),
so the three wire formats' golden tests cannot drift apart in how they check.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.api.streaming import Projector
from services.api.wire.sse import encode
from shared.events import AnyEvent

__all__ = ["assert_golden", "project"]


def project(projector: Projector, events: list[AnyEvent]) -> bytes:
    """Project events into the SSE bytes a client receives.

    Args:
        projector: a fresh projector for the request.
        events: the request's whole stream.

    Returns:
        The encoded frames, ``close()``'s included.
    """
    frames = [frame for event in events for frame in projector.feed(event)]
    frames += projector.close()
    return b"".join(encode(frame) for frame in frames)


def assert_golden(path: Path, actual: bytes) -> None:
    """Assert that ``actual`` equals the golden file (rewrite it first when regenerating).

    Args:
        path: the golden ``.sse`` file.
        actual: the transcript just produced.
    """
    if os.environ.get("SLUICE_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(actual)
    assert path.exists(), f"missing {path}; regenerate with SLUICE_UPDATE_GOLDEN=1"
    assert actual == path.read_bytes()
