"""``sluice api``: serve the app with uvicorn on ``settings.host:settings.port``."""

from __future__ import annotations

import importlib.util
import logging

import uvicorn

from services.api.app import create_app
from shared.config import Settings

__all__ = ["run_api"]


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _QuietProbes(logging.Filter):
    """Drop access-log lines for health probes.

    Launchers, compose and load balancers poll ``/healthz`` and ``/readyz`` several times a
    second; logging each one buries the requests an operator is looking for.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) >= 3 else ""
        return path not in ("/healthz", "/readyz")


def run_api(settings: Settings) -> int:
    """Run the API server until interrupted.

    Args:
        settings: the process settings.

    Returns:
        The process exit code.
    """
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # Slow SSE clients are handled by the hub's back-pressure; don't let uvicorn cut
        # long-lived streams or buffer them.
        timeout_keep_alive=30,
        # The C event loop and HTTP parser roughly halve the per-event cost of a stream;
        # uvicorn[standard] installs both, a bare uvicorn falls back to asyncio + h11.
        loop="uvloop" if _has("uvloop") else "asyncio",
        http="httptools" if _has("httptools") else "h11",
    )
    server = uvicorn.Server(config)  # configures uvicorn's loggers, so filter after it
    logging.getLogger("uvicorn.access").addFilter(_QuietProbes())
    server.run()
    return 0 if server.started else 1
