"""Which wire format a path speaks: each format's router owns its path prefix.

A format's routes live under one prefix (``/v1/chat/completions``, ``/api`` for Ollama, ...),
declared once, on its ``FormatRouter``, together with the format's name (the ``format`` label
of the metrics) and its error envelope. The metrics and the error handlers ask ``owner_of``
instead of keeping their own tables of paths, so a new format, or a new route of one, cannot
leave them behind. Paths no format owns (``/v1/models``, ``/tokenize``, ``/healthz``) are
``other`` and answer errors in OpenAI's envelope, the one most clients of those routes read.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from shared.errors import ServiceError

__all__ = ["Envelope", "FormatRouter", "format_of", "owner_of"]

# A format's error body: the status and JSON body a ``ServiceError`` becomes.
Envelope = Callable[[ServiceError], tuple[int, dict[str, object]]]

_ROUTERS: list[FormatRouter] = []


class FormatRouter(APIRouter):
    """A wire format's routes, all under the prefix the format owns."""

    def __init__(self, prefix: str, name: str, envelope: Envelope) -> None:
        """Register the format; every route of this router is relative to ``prefix``.

        Args:
            prefix: the path prefix, without a trailing slash.
            name: the format's name, as the metrics label it.
            envelope: the format's error body.

        Raises:
            ValueError: another format already owns a prefix that overlaps this one.
        """
        super().__init__(prefix=prefix)
        self.format = name
        self.envelope = envelope
        for other in _ROUTERS:
            if _under(prefix, other.prefix) or _under(other.prefix, prefix):
                raise ValueError(f"{prefix} overlaps {other.prefix} ({other.format})")
        _ROUTERS.append(self)

    def owns(self, path: str) -> bool:
        """Whether ``path`` is this format's (the prefix itself or anything below it)."""
        return _under(path, self.prefix)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def owner_of(path: str) -> FormatRouter | None:
    """The format router that owns ``path``, or None outside every format's prefix."""
    return next((r for r in _ROUTERS if r.owns(path)), None)


def format_of(path: str) -> str:
    """The wire format a request path speaks (``other`` outside the formats' prefixes)."""
    owner = owner_of(path)
    return owner.format if owner is not None else "other"
