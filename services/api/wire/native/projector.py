"""The native API's projection: each event as one named SSE frame carrying its own JSON."""

from __future__ import annotations

import msgspec

from services.api.wire import sse
from shared.events import AnyEvent

__all__ = ["NativeProjector"]

_JSON = msgspec.json.Encoder()


class NativeProjector:
    """Each event as one named SSE frame carrying the event's own JSON."""

    def feed(self, event: AnyEvent) -> list[sse.Frame]:
        """One frame per event: ``event:`` is the tag, ``data:`` the JSON event."""
        return [sse.Frame(data=_JSON.encode(event), event=str(event.__struct_config__.tag))]

    def close(self) -> list[sse.Frame]:
        """No sentinel: the terminal event (``finish``/``error``) ends the stream."""
        return []
