"""A response's input items as ``GET /v1/responses/{id}/input_items`` lists them.

Owns turning a request's ``input`` into the items OpenAI stores (every item gets an id; a plain
string becomes a user ``message``; string ``content`` becomes ``input_text`` / ``output_text``
parts; messages get ``status: completed``) and the cursor page the SDK's
``client.responses.input_items.list`` reads (``order``, ``after``, ``limit``, ``has_more``).
Ids the client sent are kept; the others derive from the response id and the position, so a
stored list reads the same every time. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from services.api.wire.common import JsonObject
from shared.errors import InvalidRequest

__all__ = ["input_items", "page"]

_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "tool_search_call": "tsc",
    "tool_search_output": "tso",
    "reasoning": "rs",
}


def _message(item: JsonObject) -> JsonObject:
    role = item.get("role")
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        part: JsonObject = {"type": kind, "text": content}
        if kind == "output_text":
            part["annotations"] = []
        content = [part]
    return {
        "type": "message",
        **item,
        "content": content,
        "status": item.get("status", "completed"),
    }


def input_items(raw: str | Sequence[JsonObject], response_id: str) -> list[JsonObject]:
    """The request's ``input`` as stored items, oldest first.

    Args:
        raw: the request's ``input`` (a string or a list of items).
        response_id: ``resp_...``, for the ids of items sent without one.

    Returns:
        The items, each with an ``id``.
    """
    items: list[JsonObject] = (
        [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
    )
    suffix = response_id.removeprefix("resp_")
    out: list[JsonObject] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        stored = _message(item) if kind == "message" else dict(item)
        if not isinstance(stored.get("id"), str):
            stored["id"] = f"{_PREFIX.get(str(kind), 'item')}_{suffix}_in{index}"
        out.append(stored)
    return out


def page(
    items: Sequence[JsonObject],
    *,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    limit: int = 20,
) -> JsonObject:
    """One page of a response's input items, as the list endpoint returns it.

    Args:
        items: the stored items, oldest first.
        order: ``desc`` (OpenAI's default: newest first) or ``asc``.
        after: an item id; the page starts after it.
        limit: 1 to 100 items.

    Returns:
        ``{"object": "list", "data", "first_id", "last_id", "has_more"}``.

    Raises:
        InvalidRequest: a limit out of range or an ``after`` id that is not in the list.
    """
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100", param="limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidRequest(f"No input item with id '{after}'", param="after")
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }
