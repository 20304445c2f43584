"""Per-request bookkeeping around the whole app: HTTP metrics and the access log line.

A pure ASGI wrapper (never ``BaseHTTPMiddleware``, which breaks streaming and disconnects): it
notes the status when the response starts and, when the last body chunk has gone out (for a
stream, after its terminal event), counts the request by route template, method, status and
wire format, observes its duration, and writes one access log line. The route template comes
from the router (``/v1/responses/{response_id}``), never the raw path, so ids cannot blow up the
label set.

Handlers add what they learn to the request's ``AccessRecord`` (``record()``, a context
variable): the request id and model at admission, token counts when the stream's ``Usage``
passes. An SSE response runs its body in a child task, which inherits the context, so the
record it fills is the one this wrapper logs; its chunks between the start and the last one go
straight to the server (``sse_asgi``), which changes nothing here: only those two are looked at.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.formats import format_of
from services.api.metrics import ApiMetrics

__all__ = ["AccessRecord", "Observe", "record"]

access_log = logging.getLogger("sluice.access")

# Polled several times a second by launchers, compose and Prometheus: counted, never logged.
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


@dataclass(slots=True)
class AccessRecord:
    """What the access log line says about one HTTP request."""

    method: str
    path: str
    format: str
    request_id: str = ""
    model: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    ttft_ms: float | None = None  # first event delivered to this client, streams only

    def usage(self, input_tokens: int, output_tokens: int) -> None:
        """Note the request's token counts (from its ``Usage`` event)."""
        self.input_tokens, self.output_tokens = input_tokens, output_tokens


_CURRENT: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar(
    "sluice_access", default=None
)


def record() -> AccessRecord | None:
    """The access record of the request being handled (None outside one)."""
    return _CURRENT.get()


class Observe:
    """Wraps the app: HTTP metrics and the access log for every HTTP request."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        """Wrap ``app``, counting into ``metrics``."""
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        rec = AccessRecord(method=scope["method"], path=path, format=format_of(path))
        token = _CURRENT.set(rec)
        began = time.perf_counter()
        status = 0
        done = False

        async def observed(message: Message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                done = True
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            _CURRENT.reset(token)
            # No final body chunk: the client left mid-stream (499, as nginx logs it) or the
            # app failed before answering (500).
            if not done:
                status = 499 if status else 500
            self._finish(scope, rec, status, time.perf_counter() - began)

    def _finish(self, scope: Scope, rec: AccessRecord, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        m = self.metrics
        m.http_requests.labels(route, rec.method, str(status), rec.format).inc()
        m.http_duration.labels(route, rec.format).observe(seconds)
        if rec.path in QUIET_PATHS or not access_log.isEnabledFor(logging.INFO):
            return
        fields: dict[str, object] = {
            "method": rec.method,
            "path": rec.path,
            "route": route,
            "status": status,
            "format": rec.format,
            "duration_ms": round(seconds * 1000, 1),
        }
        for name in ("request_id", "model", "input_tokens", "output_tokens", "ttft_ms"):
            value = getattr(rec, name)
            if value not in (None, ""):
                fields[name] = value
        line = "%s %s %d %.1fms"
        access_log.info(
            line, rec.method, rec.path, status, seconds * 1000, extra={"fields": fields}
        )
