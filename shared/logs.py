"""Logging for every sluice process: one line per event, as text or JSON, with request fields.

``configure(settings)`` is called once by each entry point (``sluice api``, ``sluice worker``):
``SLUICE_LOG_FORMAT=json`` writes one JSON object per line (for Loki, Elasticsearch, CloudWatch),
``text`` (the default) a readable line with the same fields appended as ``key=value``.

Fields come from two places. ``bind(request_id=..., model=..., worker=..., attempt=...)`` puts
them in a context variable, so every line logged while handling that request (in that task and
in the tasks it starts) carries them without passing them around; and a call may add its own
with ``extra={"fields": {...}}`` (the API's access log line does). Prompt and output text are
never logged unless ``SLUICE_LOG_CONTENT=true`` (``Settings.log_content``): code that could log
them asks ``content_enabled()`` first.

Nothing here does I/O at import.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import IO, Any

from shared.config import Settings

__all__ = [
    "JsonFormatter",
    "TextFormatter",
    "bind",
    "configure",
    "content_enabled",
    "fields",
    "make_handler",
    "set_content",
]

_FIELDS: contextvars.ContextVar[dict[str, object] | None] = contextvars.ContextVar(
    "sluice_log_fields", default=None
)
_CONTENT = [False]  # process-wide, set by configure() (set_content): no per-request switch


def bind(**values: object) -> None:
    """Add fields to every line logged from here on in this context (None values are dropped)."""
    _FIELDS.set({**(_FIELDS.get() or {}), **{k: v for k, v in values.items() if v is not None}})


def fields(record: logging.LogRecord) -> dict[str, object]:
    """The structured fields of ``record``: the bound ones, then the call's own."""
    out = dict(_FIELDS.get() or {})
    extra = getattr(record, "fields", None)
    if isinstance(extra, dict):
        out.update(extra)
    return out


def content_enabled() -> bool:
    """Whether prompt and output text may be logged (``SLUICE_LOG_CONTENT``)."""
    return _CONTENT[0]


def set_content(enabled: bool) -> None:
    """Allow or forbid logging prompt and output text (``configure`` calls it)."""
    _CONTENT[0] = enabled


class _Fields(logging.Filter):
    """Captures the bound fields when the record is made, in the context that logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.sluice_fields = fields(record)
        return True


def _captured(record: logging.LogRecord) -> dict[str, object]:
    captured = getattr(record, "sluice_fields", None)
    return captured if isinstance(captured, dict) else fields(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the fields, and exc if any."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as one line of JSON."""
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_captured(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...``, the readable twin of ``JsonFormatter``."""

    def __init__(self) -> None:
        """Use the same layout in every process."""
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as one line (plus a traceback, if any)."""
        line = super().format(record)
        extra = _captured(record)
        if not extra:
            return line
        pairs = " ".join(f"{k}={v}" for k, v in extra.items())
        head, newline, rest = line.partition("\n")
        return f"{head} {pairs}{newline}{rest}"


def make_handler(stream: IO[str], *, json_lines: bool) -> logging.Handler:
    """A handler writing one line per record to ``stream``, with the structured fields."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    handler.addFilter(_Fields())
    return handler


def configure(settings: Settings) -> None:
    """Route every logger of this process to stderr in ``settings.log_format``."""
    handler = make_handler(sys.stderr, json_lines=settings.log_format == "json")
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    set_content(settings.log_content)
