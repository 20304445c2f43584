"""Msgpack codec for events and jobs, and the stream-entry envelope.

Each Redis stream entry has two fields: ``v`` (schema version, ASCII digits) and ``e``. Since
schema version 2, ``e`` is a msgpack array of events: everything one sequence produced in one
decode step (``Start`` + the first ``TextDelta``, the last delta + ``Usage`` + ``Finish``, the
several tokens of a multi-token step), so Redis writes grow with steps, not events. Version 1
entries (``e`` is one msgpack event) are what older workers wrote; logs of them live for the
retention, so ``decode_entry`` reads both and always returns a list. Encoders and decoders are
built once at module scope because msgspec's codec objects cache type information (msgspec perf
tips).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec

from shared.errors import ProtocolError
from shared.events import AnyEvent
from shared.jobs import Job

__all__ = [
    "SCHEMA_VERSION",
    "decode_entries",
    "decode_entry",
    "decode_event",
    "decode_job",
    "encode_entry",
    "encode_event",
    "encode_events",
    "encode_job",
]

SCHEMA_VERSION = 2
_V1 = b"1"  # one event per entry (older workers)
_CURRENT = str(SCHEMA_VERSION).encode()  # compared as bytes: no int() per entry

_ENCODER = msgspec.msgpack.Encoder()
_EVENT_DECODER: msgspec.msgpack.Decoder[AnyEvent] = msgspec.msgpack.Decoder(AnyEvent)
_EVENTS_DECODER = msgspec.msgpack.Decoder(list[AnyEvent])
_JOB_DECODER = msgspec.msgpack.Decoder(Job)


def encode_event(event: AnyEvent) -> bytes:
    """Encode one event as msgpack."""
    return _ENCODER.encode(event)


def decode_event(data: bytes) -> AnyEvent:
    """Decode one msgpack event.

    Raises:
        ProtocolError: the bytes are not a known event (e.g. a newer producer's tag).
    """
    try:
        return _EVENT_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable event: {exc}") from exc


def encode_events(events: Sequence[AnyEvent]) -> bytes:
    """Encode the body of one entry: a msgpack array of events (schema version 2)."""
    return _ENCODER.encode(list(events))


def encode_entry(events: AnyEvent | Sequence[AnyEvent]) -> dict[bytes, bytes]:
    """Build the field map for one XADD holding ``events`` (one event or a step's list)."""
    batch = list(events) if isinstance(events, Sequence) else [events]
    return {b"v": str(SCHEMA_VERSION).encode(), b"e": encode_events(batch)}


def decode_entry(fields: Mapping[bytes, bytes]) -> list[AnyEvent]:
    """Decode the field map of one stream entry into its events (one or more, in order).

    Raises:
        ProtocolError: missing fields, an empty entry, or a schema version newer than this
            consumer.
    """
    version, body = fields.get(b"v"), fields.get(b"e")
    if version is None or body is None:
        raise ProtocolError("stream entry without v/e fields")
    if version == _V1:
        return [decode_event(body)]
    if version != _CURRENT and int(version) > SCHEMA_VERSION:
        raise ProtocolError(f"event schema v{int(version)} is newer than v{SCHEMA_VERSION}")
    try:
        events = _EVENTS_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable entry: {exc}") from exc
    if not events:
        raise ProtocolError("stream entry without events")
    return events


def decode_entries(entries: Iterable[tuple[object, Mapping[bytes, bytes]]]) -> list[AnyEvent]:
    """The events of ``(entry id, fields)`` pairs (an XRANGE reply), in order, flattened.

    Raises:
        ProtocolError: an entry does not decode.
    """
    return [event for _, fields in entries for event in decode_entry(fields)]


def encode_job(job: Job) -> bytes:
    """Encode a job payload (the arq argument) as msgpack; never pickle."""
    return _ENCODER.encode(job)


def decode_job(data: bytes) -> Job:
    """Decode a job payload (a tokenized ``Job``).

    Raises:
        ProtocolError: the bytes are not a valid job.
    """
    try:
        return _JOB_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable job: {exc}") from exc
