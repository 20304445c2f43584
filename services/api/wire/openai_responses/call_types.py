"""The Responses output items and stream events of calls that are not plain functions.

``custom_tool_call`` (a freeform tool's call, its ``input`` free text) with its
``response.custom_tool_call_input.*`` events, and ``tool_search_call`` (a client-executed tool
search, its ``arguments`` an object). Field names follow the official SDK's types. Kept apart
from ``types`` only to keep modules small; ``types`` folds them into ``OutputItem`` and
``StreamEvent``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "CustomToolCallInputDelta",
    "CustomToolCallInputDone",
    "CustomToolCallItem",
    "ToolSearchCallItem",
]

_Status = Literal["in_progress", "completed", "incomplete"]


class CustomToolCallItem(
    msgspec.Struct, tag_field="type", tag="custom_tool_call", kw_only=True, omit_defaults=True
):
    """A call of a freeform tool: ``id`` is the item (``ctc_``), ``call_id`` the call.

    ``namespace`` (the only default) is left out unless the tool sits in a namespace.
    """

    id: str
    status: _Status
    call_id: str
    input: str
    name: str
    namespace: str | None = None


class ToolSearchCallItem(msgspec.Struct, tag_field="type", tag="tool_search_call", kw_only=True):
    """A client-executed tool search the model asked for (``tsc_`` item id)."""

    id: str
    status: _Status
    arguments: object = msgspec.field(default_factory=dict)
    call_id: str
    execution: Literal["server", "client"] = "client"


class CustomToolCallInputDelta(
    msgspec.Struct, tag_field="type", tag="response.custom_tool_call_input.delta"
):
    """A fragment of a freeform call's input."""

    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class CustomToolCallInputDone(
    msgspec.Struct, tag_field="type", tag="response.custom_tool_call_input.done"
):
    """A freeform call's complete input."""

    item_id: str
    output_index: int
    input: str
    sequence_number: int
