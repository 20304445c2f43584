"""A real uvicorn server in a background thread, for the SDK conformance tests.

Each conformance module serves golden transcripts from a tiny Starlette app and points an
official SDK at it. A thread (not the test's event loop) lets the synchronous SDK clients call
it, and a real socket gives the SDKs real streaming: ``httpx.ASGITransport`` buffers bodies.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = ["serve_post"]


@contextlib.contextmanager
def serve_post(path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> Iterator[str]:
    """Serve one POST endpoint on a free loopback port for the duration of the block.

    Args:
        path: the route, e.g. ``/v1/messages``.
        endpoint: the handler that answers with a transcript.

    Yields:
        The base URL, e.g. ``http://127.0.0.1:41234``.
    """
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = Starlette(routes=[Route(path, endpoint, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "transcript server died"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
