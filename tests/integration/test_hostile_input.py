"""Bodies built to crash a parser are a 400 in the route's own error shape, never a 500.

Invalid UTF-8 inside a JSON string, JSON nested a thousand deep, a tool schema nested a few
hundred deep (deep enough for any recursive walk of it), and integers too large for the job's
64-bit encoding, on every route that takes a body.
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
    if route.startswith("/v1/messages"):
        return [{"name": "f", "input_schema": schema}]
    if route == "/v1/responses":
        return [{"type": "function", "name": "f", "parameters": schema}]
    return [{"name": "f", "parameters": schema}]


def _body(route: str, model: str, **extra: object) -> dict[str, object]:
    if route == "/v1/responses":
        return {"model": model, "input": "hello", **extra}
    body: dict[str, object] = {"model": model, "messages": [USER]}
    if route == "/v1/messages":
        body["max_tokens"] = 8
    body.update(extra)
    if route == "/v1/requests":
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    return body


ROUTES = [
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/requests",
]
HUGE = 2**64  # one past what msgpack holds
# Where each route takes an integer a client can make too large (each was a 500).
HUGE_FIELDS: dict[str, list[dict[str, object]]] = {
    "/v1/chat/completions": [
        {"top_k": HUGE},
        {"seed": HUGE},
        {"max_tokens": HUGE},
        {"max_completion_tokens": HUGE},
        {"n": HUGE},
        {"logprobs": True, "top_logprobs": HUGE},
        {"min_tokens": HUGE},
    ],
    "/v1/messages": [
        {"top_k": HUGE},
        {"max_tokens": HUGE},
        {"thinking": {"type": "enabled", "budget_tokens": HUGE}},
    ],
    "/v1/messages/count_tokens": [{"top_k": HUGE}],
    "/v1/responses": [
        {"max_output_tokens": HUGE},
        {"top_logprobs": HUGE},
        {"max_tool_calls": HUGE},
    ],
    "/v1/requests": [
        {"sampling": {"top_k": HUGE}},
        {"sampling": {"top_k": 2**63}},
        {"sampling": {"seed": HUGE}},
        {"max_tokens": HUGE},
        {"min_tokens": HUGE},
        {"reasoning": {"budget_tokens": HUGE}},
    ],
}


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
    _assert_400(route, reply)
    assert await redis.zcard(keys.queue(tiny_model.name)) == 0


def _assert_400(route: str, reply: httpx.Response) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()
    if route.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert error["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("route", ROUTES)
async def test_integers_past_64_bits_are_a_400_in_the_format_shape(
    api: str, tiny_model: ModelCard, redis: aioredis.Redis, route: str
) -> None:
    # Free-form JSON carries numbers too: a tool schema's bound reaches the job's encoder.
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": HUGE}}}
    bodies = [*HUGE_FIELDS[route], {"tools": _tools(route, schema)}]
    async with httpx.AsyncClient(base_url=api, timeout=30) as client:
        for fields in bodies:
            body = _body(route, tiny_model.name, **fields)
            reply = await client.post(route, json=body)
            if route == "/v1/messages/count_tokens" and "tools" in fields:
                assert reply.status_code == 200, reply.text  # counting encodes no job
                continue
            _assert_400(route, reply)
    assert await redis.zcard(keys.queue(tiny_model.name)) == 0
