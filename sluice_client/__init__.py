"""sluice's client: typed inference events from a live server, a recording or a script.

The transport boundary an agent loop needs: the same ``async for item in source.events()`` runs
against a live server (``LiveSource``), a recorded JSONL stream (``RecordedSource``) or a scripted
scenario (``ScriptedSource``); those live in ``sluice_client.sources``. ``export_stream`` writes
such a JSONL file straight from Redis and ``cli_export``/``cli_replay`` back ``sluice export``/
``sluice replay``; those live in ``sluice_client.export``. This package is not part of the
contract between the services: it depends on ``shared`` (events, codec, keys, errors) and on
neither service, and nothing in ``shared`` imports it.
"""

from __future__ import annotations

from sluice_client.export import cli_export, cli_replay, export_stream
from sluice_client.sources import (
    EventSource,
    LiveSource,
    RecordedSource,
    ScriptedSource,
    StreamEvent,
    read_all,
)

__all__ = [
    "EventSource",
    "LiveSource",
    "RecordedSource",
    "ScriptedSource",
    "StreamEvent",
    "cli_export",
    "cli_replay",
    "export_stream",
    "read_all",
]
