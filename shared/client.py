"""A small async client that yields typed inference events from one of three sources.

The transport boundary an agent loop needs: the same ``async for item in source.events()`` runs
against a live server (``LiveSource``), a recorded JSONL stream (``RecordedSource``) or a scripted
scenario (``ScriptedSource``); those live in ``shared.sources``. ``export_stream`` writes such a
JSONL file straight from Redis and ``cli_export``/``cli_replay`` back ``sluice export``/``sluice
replay``; those live in ``shared.export``. This module is the one import path for both.
"""

from __future__ import annotations

from shared.export import cli_export, cli_replay, export_stream
from shared.sources import (
    EventSource,
    LiveSource,
    RecordedSource,
    ScriptedSource,
    StreamEvent,
    collect,
)

__all__ = [
    "EventSource",
    "LiveSource",
    "RecordedSource",
    "ScriptedSource",
    "StreamEvent",
    "cli_export",
    "cli_replay",
    "collect",
    "export_stream",
]
