"""The log formats: the same fields as JSON or as ``key=value``, bound per context."""

from __future__ import annotations

import contextvars
import io
import json
import logging

from shared import logs
from shared.config import Settings


def emit(json_lines: bool, **extra: object) -> str:
    stream = io.StringIO()
    logger = logging.getLogger("sluice.test.logs")
    logger.propagate = False
    handler = logs.make_handler(stream, json_lines=json_lines)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("hello %s", "there", extra={"fields": extra} if extra else None)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_bound_and_call_fields_in_both_formats() -> None:
    def run() -> tuple[str, str]:
        logs.bind(request_id="req_1", model="m", attempt=2)
        return emit(True, status=200), emit(False, status=200)

    as_json, as_text = contextvars.copy_context().run(run)
    entry = json.loads(as_json)
    assert entry["msg"] == "hello there" and entry["level"] == "info"
    assert entry["request_id"] == "req_1" and entry["attempt"] == 2 and entry["status"] == 200
    assert as_text.rstrip().endswith("hello there request_id=req_1 model=m attempt=2 status=200")
    # Bound in another context: nothing leaks into this one.
    assert "request_id" not in json.loads(emit(True))


def test_settings_choose_the_format_and_content() -> None:
    assert Settings.from_env({}).log_format == "text"
    assert Settings.from_env({"SLUICE_LOG_FORMAT": "json"}).log_format == "json"
    assert Settings.from_env({}).log_content is False
    assert not logs.content_enabled()
