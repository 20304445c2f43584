"""Typed event sources: one ``async for item in source.events()`` over three transports.

Owns ``StreamEvent`` (an event with its Redis entry id and offset; also the JSONL record format)
and the sources an agent loop reads from: ``LiveSource`` (submit a job to the native API, stream
``/v1/requests/{id}/events``, reconnect with ``Last-Event-ID`` when the connection drops),
``RecordedSource`` (a JSONL export replayed with its original timing or as fast as possible) and
``ScriptedSource``. Timing comes from the entry ids, i.e. the worker's XADD times. This module
imports no service; httpx is imported inside the functions that use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from shared.errors import (
    AuthenticationFailed,
    InvalidRequest,
    NotFound,
    NoWorker,
    Overloaded,
    PermissionDenied,
    ProtocolError,
    RateLimited,
    RequestTooLarge,
    ServiceError,
)
from shared.events import AnyEvent, is_terminal
from shared.jobs import GenerateRequest

if TYPE_CHECKING:
    import httpx

__all__ = [
    "EventSource",
    "LiveSource",
    "RecordedSource",
    "ScriptedSource",
    "StreamEvent",
    "entry_ms",
    "read_all",
]

_SERVER_FIELDS = ("request_id", "owner", "created", "prompt_token_ids", "prompt_text", "origin")
_EVENT_JSON = msgspec.json.Decoder(AnyEvent)


class StreamEvent(msgspec.Struct, frozen=True):
    """One event with where it sits in its stream; also the JSONL record format."""

    id: str  # Redis entry id ("" for scripted events)
    t_ms: float  # milliseconds since the stream's first event
    event: AnyEvent


_LINE_DECODER = msgspec.json.Decoder(StreamEvent)
_JSON = msgspec.json.Encoder()


class EventSource(Protocol):
    """Anything that yields a request's events in order, ending with the terminal one."""

    def events(self) -> AsyncIterator[StreamEvent]:
        """Yield the stream's events."""
        ...


def entry_ms(entry_id: str) -> int:
    """The millisecond part of a Redis stream entry id (its XADD time).

    Args:
        entry_id: e.g. ``1700000000000-0``.

    Returns:
        The milliseconds since the epoch (0 for an empty id).
    """
    return int(entry_id.partition("-")[0] or 0)


async def read_all(source: EventSource) -> list[AnyEvent]:
    """All events of a source, in order.

    Args:
        source: any event source.

    Returns:
        The events (the last is terminal for a complete stream).
    """
    return [item.event async for item in source.events()]


class ScriptedSource:
    """A fixed list of events, optionally spaced ``delay_s`` apart (tests, demos)."""

    def __init__(self, events: Sequence[AnyEvent], delay_s: float = 0.0) -> None:
        """Script the events to yield.

        Args:
            events: the events, in order.
            delay_s: pause before every event after the first.
        """
        self._events = list(events)
        self._delay_s = delay_s

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Yield the scripted events."""
        for i, event in enumerate(self._events):
            if i and self._delay_s:
                await asyncio.sleep(self._delay_s)
            yield StreamEvent(id="", t_ms=i * self._delay_s * 1000, event=event)


class RecordedSource:
    """A JSONL export (one ``StreamEvent`` per line) replayed fast or with its original timing."""

    def __init__(self, path: str | Path, realtime: bool = False) -> None:
        """Point at a recording.

        Args:
            path: the JSONL file.
            realtime: keep the recorded gaps between events instead of replaying at once.
        """
        self._path = Path(path)
        self._realtime = realtime

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Yield the recorded events.

        Raises:
            ProtocolError: a line is not a ``StreamEvent``.
        """
        data = await asyncio.to_thread(self._path.read_bytes)
        started = time.monotonic()
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = _LINE_DECODER.decode(line)
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"{self._path}:{number}: {exc}") from exc
            if self._realtime:
                delay = item.t_ms / 1000 - (time.monotonic() - started)
                if delay > 0:
                    await asyncio.sleep(delay)
            yield item


_STATUS_ERRORS: dict[int, type[ServiceError]] = {
    400: InvalidRequest,
    401: AuthenticationFailed,
    403: PermissionDenied,
    404: NotFound,
    413: RequestTooLarge,
    429: RateLimited,
    503: NoWorker,
    529: Overloaded,
}


def _raise_for(response: httpx.Response, body: bytes) -> None:
    if response.status_code < 400:
        return
    message = body.decode(errors="replace")
    try:
        decoded = msgspec.json.decode(body)
        if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):
            message = str(decoded["error"].get("message", message))
    except msgspec.DecodeError:
        pass
    cls = _STATUS_ERRORS.get(response.status_code, ServiceError)
    retry = response.headers.get("retry-after")
    raise cls(message, retry_after=float(retry) if retry and retry.isdigit() else None)


class LiveSource:
    """Events of a request on a running sluice server (the native API).

    Give either ``job`` (submitted on first iteration) or ``request_id`` (an existing request).
    A dropped connection is resumed with ``Last-Event-ID``, so no event is lost or repeated.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        job: GenerateRequest | Mapping[str, object] | None = None,
        request_id: str | None = None,
        max_reconnects: int = 5,
        timeout_s: float = 60.0,
    ) -> None:
        """Configure the source.

        Args:
            base_url: the server, e.g. ``http://127.0.0.1:8000``.
            api_key: sent as ``Authorization: Bearer``; None when auth is off.
            job: the job to submit (its server-assigned fields are ignored).
            request_id: stream an existing request instead.
            max_reconnects: reconnect attempts in a row without progress before giving up.
            timeout_s: read timeout; the server sends keepalives well within it.
        """
        if (job is None) == (request_id is None):
            raise ValueError("give exactly one of job and request_id")
        self.base_url = base_url.rstrip("/")
        self.request_id = request_id
        self.reconnects = 0
        self._job = job
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_reconnects = max_reconnects
        self._timeout_s = timeout_s

    def _client(self) -> httpx.AsyncClient:
        import httpx

        timeout = httpx.Timeout(10.0, read=self._timeout_s)
        return httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=timeout)

    async def submit(self) -> str:
        """Submit the job (once) and return its request id.

        Raises:
            ServiceError: the server rejected it (the subclass follows the HTTP status).
        """
        if self.request_id is not None:
            return self.request_id
        assert self._job is not None
        raw = msgspec.to_builtins(self._job)
        body = {k: v for k, v in raw.items() if k not in _SERVER_FIELDS}
        async with self._client() as client:
            response = await client.post("/v1/requests", content=_JSON.encode(body))
            _raise_for(response, response.content)
        self.request_id = str(response.json()["id"])
        return self.request_id

    async def cancel(self) -> None:
        """Ask the server to stop the generation."""
        rid = await self.submit()
        async with self._client() as client:
            response = await client.post(f"/v1/requests/{rid}/cancel")
            _raise_for(response, response.content)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Yield the request's events, reconnecting after drops, until the terminal event.

        Raises:
            ServiceError: the server refused the stream, or reconnecting kept failing.
        """
        import httpx

        rid = await self.submit()
        last_id = "0-0"
        first_ms: int | None = None
        failures = 0
        async with self._client() as client:
            while True:
                try:
                    async for entry_id, event in self._once(client, rid, last_id):
                        failures = 0
                        first_ms = entry_ms(entry_id) if first_ms is None else first_ms
                        last_id = entry_id
                        yield StreamEvent(entry_id, entry_ms(entry_id) - first_ms, event)
                        if is_terminal(event):
                            return
                except (httpx.TransportError, ProtocolError) as exc:
                    reason: str = repr(exc)
                else:
                    reason = "stream ended before its terminal event"
                failures += 1
                self.reconnects += 1
                if failures > self._max_reconnects:
                    raise ServiceError(f"lost the event stream of {rid}: {reason}")
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))

    async def _once(
        self, client: httpx.AsyncClient, rid: str, last_id: str
    ) -> AsyncIterator[tuple[str, AnyEvent]]:
        headers = {"last-event-id": last_id} if last_id != "0-0" else {}
        async with client.stream("GET", f"/v1/requests/{rid}/events", headers=headers) as resp:
            if resp.status_code >= 400:
                _raise_for(resp, await resp.aread())
            data: list[str] = []
            entry_id: str | None = None
            # An entry holds a decode step's events; only its last event's frame has the id.
            # The others wait for it, so every event yielded is resumable after its own id and
            # a connection that drops mid-entry repeats nothing on resume.
            pending: list[AnyEvent] = []
            async for line in resp.aiter_lines():
                if line.startswith(":"):
                    continue
                if line:
                    name, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "data":
                        data.append(value)
                    elif name == "id":
                        entry_id = value
                    continue
                if data:
                    try:
                        pending.append(_EVENT_JSON.decode("\n".join(data)))
                    except msgspec.DecodeError as exc:
                        raise ProtocolError(f"undecodable event from server: {exc}") from exc
                    if entry_id is not None:
                        for event in pending:
                            yield entry_id, event
                        pending = []
                data = []
                entry_id = None
