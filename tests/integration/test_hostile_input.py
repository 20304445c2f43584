"""Bodies built to crash a parser are a 400 in the route's own error shape, never a 500.

Invalid UTF-8 inside a JSON string, JSON nested a thousand deep, and a tool schema nested a few
hundred deep (deep enough for any recursive walk of it), on every route that takes a body.
"""

from __future__ import annotations

import json

import httpx
import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.model_card import ModelCard

pytestmark = pytest.mark.integration

USER = {"role": "user", "content": "hello"}


def _deep(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tools(route: str, schema: dict[str, object]) -> list[dict[str, object]]:
    if route == "/v1/chat/completions":
        return [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    if route == "/v1/messages":
        return [{"name": "f", "input_schema": schema}]
    if route == "/v1/responses":
        return [{"type": "function", "name": "f", "parameters": schema}]
    return [{"name": "f", "parameters": schema}]


def _body(route: str, model: str, **extra: object) -> dict[str, object]:
    if route == "/v1/responses":
        return {"model": model, "input": "hello", **extra}
    body: dict[str, object] = {"model": model, "messages": [USER], **extra}
    if route == "/v1/messages":
        body["max_tokens"] = 8
    if route == "/v1/requests":
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    return body


ROUTES = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/requests"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["invalid_utf8", "nested_json", "nested_tool_schema"])
async def test_hostile_body_is_a_400_in_the_format_shape(
    api: str, tiny_model: ModelCard, redis: aioredis.Redis, route: str, case: str
) -> None:
    if case == "invalid_utf8":
        raw = json.dumps(_body(route, tiny_model.name)).encode().replace(b"hello", b"he\xffllo")
    elif case == "nested_json":
        raw = json.dumps(_body(route, tiny_model.name))[:-1].encode()
        raw += b', "metadata": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    else:
        body = _body(route, tiny_model.name, tools=_tools(route, _deep(300)))
        raw = json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=api, timeout=30) as client:
        reply = await client.post(route, content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    if route == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert error["error"]["type"] == "invalid_request_error"
    assert await redis.zcard(keys.queue(tiny_model.name)) == 0
