"""Msgpack codec for events and jobs, and the stream-entry envelope.

Each Redis stream entry has two fields: ``v`` (schema version, ASCII digits) and ``e`` (the
msgpack-encoded event). Encoders and decoders are built once at module scope because msgspec's
codec objects cache type information (msgspec perf tips).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from shared.errors import ProtocolError
from shared.events import AnyEvent
from shared.jobs import Job

__all__ = [
    "SCHEMA_VERSION",
    "decode_entry",
    "decode_event",
    "decode_job",
    "encode_entry",
    "encode_event",
    "encode_job",
]

SCHEMA_VERSION = 1

_ENCODER = msgspec.msgpack.Encoder()
_EVENT_DECODER: msgspec.msgpack.Decoder[AnyEvent] = msgspec.msgpack.Decoder(AnyEvent)
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


def encode_entry(event: AnyEvent) -> dict[bytes, bytes]:
    """Build the field map for one XADD."""
    return {b"v": str(SCHEMA_VERSION).encode(), b"e": _ENCODER.encode(event)}


def decode_entry(fields: Mapping[bytes, bytes]) -> AnyEvent:
    """Decode the field map of one stream entry.

    Raises:
        ProtocolError: missing fields or a schema version newer than this consumer.
    """
    version, body = fields.get(b"v"), fields.get(b"e")
    if version is None or body is None:
        raise ProtocolError("stream entry without v/e fields")
    if int(version) > SCHEMA_VERSION:
        raise ProtocolError(f"event schema v{int(version)} is newer than v{SCHEMA_VERSION}")
    return decode_event(body)


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
