"""``input_items``, ``input_tokens`` and unknown routes, through the official openai SDK.

Real uvicorn, real Redis and a scripted worker (whose card carries a real tokenizer and chat
template, so token counts are the admission's own).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from openai.types.responses import Response as SdkResponse

from tests.integration.worker_harness import WorkerHandle

pytestmark = pytest.mark.integration

MODEL = "scripted-text"


@pytest.fixture
async def client(api: str, steady_worker: WorkerHandle) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as c:
        yield c


async def test_input_items_list_what_the_request_sent(client: openai.AsyncOpenAI) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "id": "msg_mine", "role": "user", "content": "Again"},
    ]
    response = await client.responses.create(model=MODEL, input=items)  # type: ignore[arg-type]
    listed = [item async for item in client.responses.input_items.list(response.id)]
    assert listed[0].id == "msg_mine"  # newest first, the client's id kept
    assert [i.type for i in listed] == ["message"] * 3
    oldest_first = await client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [getattr(i, "role", None) for i in oldest_first.data] == ["developer", "user"]
    assert oldest_first.has_more
    rest = await client.responses.input_items.list(
        response.id, order="asc", after=oldest_first.data[-1].id
    )
    assert [i.id for i in rest.data] == ["msg_mine"] and not rest.has_more
    content = oldest_first.data[0].content  # type: ignore[union-attr]
    assert content[0].type == "input_text" and content[0].text == "Be brief."  # type: ignore[union-attr]
    text = await client.responses.create(model=MODEL, input="plain")
    (only,) = [item async for item in client.responses.input_items.list(text.id)]
    assert only.type == "message" and only.role == "user"  # type: ignore[union-attr]


async def test_input_tokens_count_equals_what_generation_reports(
    client: openai.AsyncOpenAI,
) -> None:
    body = {"model": MODEL, "input": "What is the weather?", "instructions": "Be brief."}
    counted = await client.responses.input_tokens.count(**body)  # type: ignore[arg-type]
    assert counted.object == "response.input_tokens"
    response = await client.responses.create(**body)  # type: ignore[call-overload]
    assert response.usage is not None
    assert counted.input_tokens == response.usage.input_tokens > 0


async def test_unknown_routes_are_404s_naming_the_route(api: str) -> None:
    async with httpx.AsyncClient(base_url=api) as http:
        for method, path in (("POST", "/v1/responses/nope/frobnicate"), ("GET", "/v1/nothing")):
            reply = await http.request(method, path)
            assert reply.status_code == 404
            assert f"{method} {path}" in reply.json()["error"]["message"]
        missing = await http.get("/v1/responses/resp_missing/input_items")
        assert missing.status_code == 404


async def test_the_full_response_object_everywhere(client: openai.AsyncOpenAI, api: str) -> None:
    body = {
        "model": MODEL,
        "input": "hi",
        "max_tool_calls": 3,
        "prompt_cache_key": "thread-1",
        "safety_identifier": "user-hash",
        "text": {"verbosity": "low"},
        "top_logprobs": 2,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=f"{api}/v1", timeout=30) as http:
        async with http.stream("POST", "/responses", json=body) as reply:
            frames = [
                json.loads(line[6:])
                async for line in reply.aiter_lines()
                if line.startswith("data: ")
            ]
        rid = frames[0]["response"]["id"]
        stored = (await http.get(f"/responses/{rid}")).json()
        plain = (await http.post("/responses", json={**body, "stream": False})).json()
    # Every field, those only hosted features fill (image, moderation, tool_usage, ...) as null.
    expected = set(SdkResponse.model_fields)
    lifecycle = [
        f["response"] for f in frames if f["type"].startswith("response.") and "response" in f
    ]
    for response in [*lifecycle, stored, plain]:
        assert expected <= set(response), expected - set(response)
        assert (response["max_tool_calls"], response["prompt_cache_key"]) == (3, "thread-1")
        assert (response["safety_identifier"], response["top_logprobs"]) == ("user-hash", 2)
        assert response["text"]["verbosity"] == "low"
        assert response["temperature"] == 1.0 and response["top_p"] == 1.0
        assert response["frequency_penalty"] == 0.0 and response["presence_penalty"] == 0.0
        assert response["image"] is None and response["tool_usage"] is None
    assert lifecycle[0]["completed_at"] is None
    completed = lifecycle[-1]
    assert completed["status"] == "completed"
    assert completed["completed_at"] == stored["completed_at"] >= completed["created_at"]
    assert plain["completed_at"] >= plain["created_at"]
    SdkResponse.model_validate(stored)
