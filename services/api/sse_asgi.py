"""The SSE response as a raw ASGI app: the fewest Python layers between a stream and its socket.

Starlette's ``StreamingResponse`` sends each chunk through every ``send`` wrapper of the stack
(the route's exception wrapper, ``Observe``, ``ServerErrorMiddleware``) and runs in an anyio task
group; at thousands of frames a second those layers cost the API more than the projection. Here:

- the response start and the last (empty) body message go through the ``send`` the stack handed
  down, so every wrapper sees the status and the end of the response as before (``Observe``
  counts and logs a stream when its last chunk has gone, and 499 when it never went);
- the chunks in between go straight to the server's own ``send``, which the app puts in the
  scope (``SERVER_SEND``; ``app.create_app``). No wrapper of this app rewrites body chunks, and
  one that must would have to set ``SERVER_SEND`` itself;
- the body runs in a child task while this one waits for ``http.disconnect``: a client that goes
  away cancels the body (its ``finally`` unsubscribes at once) and, if the stream had not ended,
  ``on_abandon`` runs. It is armed around the whole response, not in the body's ``finally``: a
  client can be gone before the body generator ever ran, and then it has no ``finally`` to run.

Each chunk is everything one hub wake-up produced for this stream (``streaming._frames`` joins an
entry batch's frames), so one wake-up is one ``http.response.body`` message and one socket write.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["SERVER_SEND", "Ending", "SSEResponse"]

SERVER_SEND = "sluice.server_send"
"""Scope key of the server's own ``send`` callable (set where the app receives the request)."""


class Ending:
    """Whether a stream's body reached its end; written by the body, read by its response."""

    finished = False


class SSEResponse(Response):
    """A streaming SSE response that cancels its request when it ends before the stream did.

    A ``Response`` subclass so FastAPI passes it through untouched; nothing of ``Response``'s
    own body handling is used.
    """

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        ending: Ending,
        on_abandon: Callable[[], None] | None,
        headers: dict[str, str],
    ) -> None:
        """Wrap ``body``; ``on_abandon`` runs if it did not finish (None: an observer)."""
        self.status_code = 200
        self.background: BackgroundTask | None = None
        self.body_iterator = body
        # As Starlette does: names lower-cased, both as latin-1 (HTTP/1.1 header bytes).
        self.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
        ]
        self._ending = ending
        self._on_abandon = on_abandon

    async def _stream(self, send: Send, direct: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await direct({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the response; whatever happens, cancel the request if the stream did not end."""
        direct: Send = scope.get(SERVER_SEND, send)
        loop = asyncio.get_running_loop()
        streaming = loop.create_task(self._stream(send, direct))
        watching = loop.create_task(_disconnected(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            results = await asyncio.gather(streaming, watching, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # unsubscribe now, not when collected
            if not self._ending.finished and self._on_abandon is not None:
                self._on_abandon()
        failure = results[0]
        if isinstance(failure, Exception):
            raise failure  # before the headers only: the body itself never raises
        if self.background is not None:
            await self.background()


async def _disconnected(receive: Receive) -> None:
    # After the last body message the server answers ``http.disconnect`` too; by then the
    # streaming task is done and this one is cancelled either way.
    while (await receive())["type"] != "http.disconnect":
        pass
