"""``/v1/responses`` end to end: official openai SDK -> real uvicorn -> Redis -> scripted worker.

``metadata.script`` picks the worker's scenario per request. For every scenario the streamed
response (``responses.stream(...).get_final_response()``), the raw event stream and the
non-streaming response agree with each other and with ``GET /v1/responses/{id}``, which renders
the events actually on the Redis stream. A Codex-style consumer sees EOF right after the terminal
event, and bad input gets OpenAI's 400 body with nothing enqueued.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from openai.types.responses import Response

from shared import keys
from shared.accumulate import fold
from shared.codec import decode_entries
from shared.events import AnyEvent
from tests.integration.worker_harness import WorkerHandle
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

MODEL = "scripted-text"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": False,
    }
]
SCRIPTS = ["text", "reasoning", "tool_call", "parallel_tool_calls", "parameterless_tool_call"]


@pytest.fixture
async def client(api: str, steady_worker: WorkerHandle) -> AsyncIterator[openai.AsyncOpenAI]:
    """The async SDK against the live API, a scripted worker behind it, no retries."""
    async with openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0) as c:
        yield c


def request(script: str, **extra: object) -> dict[str, object]:
    """A create body for ``script`` (tools declared for the tool scenarios)."""
    return {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "instructions": "Answer briefly.",
        "metadata": {"script": script},
        **({"tools": TOOLS} if "tool" in script else {}),
        **extra,
    }


async def stream_events(redis: aioredis.Redis, rid: str) -> list[AnyEvent]:
    """The events the worker published for ``rid``, checked against the invariants."""
    events = decode_entries(await redis.xrange(keys.events(rid)))
    check_stream(events)
    return events


def plain(response: Response) -> dict[str, object]:
    """The response as JSON-able data, minus the stream helper's ``parsed*`` additions."""

    def strip(value: object) -> object:
        if isinstance(value, dict):
            return {
                k: strip(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")
            }
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    out = strip(response.model_dump())
    assert isinstance(out, dict)
    return out


def answer(response: Response) -> tuple[object, ...]:
    """What a client acts on, without ids: text, reasoning, calls, status, usage."""
    reasoning = [
        "".join(c.text for c in item.content or [])
        for item in response.output
        if item.type == "reasoning"
    ]
    calls = [
        (item.name, item.arguments) for item in response.output if item.type == "function_call"
    ]
    usage = response.usage.model_dump() if response.usage else None
    return response.output_text, reasoning, calls, response.status, usage


@pytest.mark.parametrize("script", SCRIPTS)
async def test_stream_raw_and_non_stream_agree_with_the_log(
    client: openai.AsyncOpenAI, redis: aioredis.Redis, script: str
) -> None:
    expected = await client.responses.create(**request(script))  # type: ignore[call-overload]
    assert expected.id.startswith("resp_")
    assert expected.status == "completed"
    events = await stream_events(redis, expected.id)
    folded = fold(events)
    assert expected.output_text == folded.text
    assert plain(await client.responses.retrieve(expected.id)) == plain(expected)

    async with client.responses.stream(**request(script)) as stream:  # type: ignore[call-overload]
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert plain(final) == plain(await client.responses.retrieve(final.id))
    assert answer(final) == answer(expected)

    raw = await client.responses.create(stream=True, **request(script))  # type: ignore[call-overload]
    items = [event async for event in raw]
    assert [e.sequence_number for e in items] == list(range(len(items)))
    last = items[-1]
    assert last.type == "response.completed"
    assert answer(last.response) == answer(expected)
    done = [e.item.model_dump() for e in items if e.type == "response.output_item.done"]
    assert done == [item.model_dump() for item in last.response.output]

    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [
        (b.name, b.arguments) for b in folded.tool_calls
    ]
    assert all(c.call_id.startswith("call_") and (c.id or "").startswith("fc_") for c in calls)
    if script == "reasoning":
        assert final.output[0].type == "reasoning"
        assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0


async def test_codex_style_client_reads_to_eof_after_completed(
    api: str, steady_worker: WorkerHandle
) -> None:
    history: list[dict[str, object]] = []
    after_terminal: list[str] = []
    terminal: dict[str, object] | None = None
    body = {**request("parallel_tool_calls"), "stream": True}
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", f"{api}/v1/responses", json=body) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        event, data = "", ""
        async for line in response.aiter_lines():  # ends only when the server closes
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
            elif not line and data:
                if terminal is not None:
                    after_terminal.append(event)
                parsed = json.loads(data)
                if event == "response.output_item.done":
                    history.append(parsed["item"])
                elif event == "response.completed":
                    terminal = parsed
                event, data = "", ""
    assert terminal is not None, "EOF before response.completed"
    assert after_terminal == []
    assert history == terminal["response"]["output"]  # type: ignore[index]
    assert [item["type"] for item in history] == ["message", "function_call", "function_call"]


async def test_max_output_tokens_is_incomplete(client: openai.AsyncOpenAI) -> None:
    done = await client.responses.create(**request("text"), max_output_tokens=3)  # type: ignore[call-overload]
    assert done.status == "incomplete"
    assert done.incomplete_details is not None
    assert done.incomplete_details.reason == "max_output_tokens"
    assert done.usage is not None and done.usage.output_tokens <= 3
    async with client.responses.stream(**request("text"), max_output_tokens=3) as stream:  # type: ignore[call-overload]
        kinds = [event.type async for event in stream]
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            await stream.get_final_response()
    assert kinds[-1] == "response.incomplete"


async def test_worker_failure_mid_stream(client: openai.AsyncOpenAI, redis: aioredis.Redis) -> None:
    raw = await client.responses.create(stream=True, **request("error"))  # type: ignore[call-overload]
    items = [event async for event in raw]
    assert [e.type for e in items[-2:]] == ["error", "response.failed"]
    failed = items[-1].response
    assert failed.status == "failed"
    assert failed.error is not None and "scripted failure" in failed.error.message
    assert failed.output_text == "This answer will fail"
    await stream_events(redis, failed.id)
    done = await client.responses.create(**request("error"))  # type: ignore[call-overload]
    assert done.status == "failed"


async def nothing_enqueued(redis: aioredis.Redis) -> bool:
    """True when no request or response was stored and nothing queued."""
    stored = [k async for k in redis.scan_iter(match="sluice:re*")]
    return not stored and await redis.zcard(keys.queue(MODEL)) == 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "x"}}}},
            "text.format.schema",
        ),
        ({"tools": [{"type": "web_searcher"}]}, "tools[0].type"),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "tool_choice.type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"max_output_tokens": "many"}, "max_output_tokens"),
        ({"previous_response_id": "resp_missing"}, "previous_response_id"),
    ],
)
async def test_bad_input_is_an_openai_400_and_nothing_is_enqueued(
    client: openai.AsyncOpenAI, redis: aioredis.Redis, extra: dict[str, object], param: str
) -> None:
    error_class = (
        openai.NotFoundError if param == "previous_response_id" else openai.BadRequestError
    )
    with pytest.raises(error_class) as info:
        await client.responses.create(**{**request("text"), **extra})  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict)
    assert body["type"] == "invalid_request_error"
    assert body["param"] == param
    assert body["message"]
    assert await nothing_enqueued(redis)


async def test_unknown_model_is_404(client: openai.AsyncOpenAI, redis: aioredis.Redis) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(**{**request("text"), "model": "nope"})  # type: ignore[call-overload]
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    assert await nothing_enqueued(redis)


async def test_rejection_before_start(client: openai.AsyncOpenAI, redis: aioredis.Redis) -> None:
    # The scripted worker rejects an unknown script before generating (an early Error).
    with pytest.raises(openai.BadRequestError, match="unknown scripted scenario"):
        await client.responses.create(**request("bogus"))  # type: ignore[call-overload]
    raw = await client.responses.create(stream=True, **request("bogus"))  # type: ignore[call-overload]
    kinds = [event.type async for event in raw]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]


async def test_namespaced_and_hosted_tools_end_to_end(client: openai.AsyncOpenAI) -> None:
    # Codex's shape: a namespace of functions plus a hosted web_search it cannot expect us to run.
    namespace = {
        "type": "namespace",
        "name": "weather",
        "description": "Weather tools",
        "tools": [{**TOOLS[0]}],
    }
    hosted = {"type": "web_search", "external_web_access": False}
    body = {**request("tool_call"), "tools": [namespace, hosted]}
    raw = await client.responses.with_raw_response.create(**body)  # type: ignore[call-overload]
    assert raw.headers["x-sluice-ignored-tools"] == "web_search"
    response = raw.parse()
    call = response.output[-1]
    assert call.type == "function_call"
    assert (call.name, call.namespace, json.loads(call.arguments)) == (
        "get_weather",
        "weather",
        {"city": "Paris"},
    )
    assert [t.type for t in response.tools] == ["namespace", "web_search"]
    async with client.responses.stream(**body) as stream:  # type: ignore[call-overload]
        final = await stream.get_final_response()
    streamed = final.output[-1]
    assert streamed.type == "function_call" and streamed.namespace == "weather"


async def test_reasoning_summary_reaches_the_sdk_stream_helper(client: openai.AsyncOpenAI) -> None:
    body = {**request("reasoning"), "reasoning": {"summary": "auto"}}
    async with client.responses.stream(**body) as stream:  # type: ignore[call-overload]
        summaries = [
            e.delta async for e in stream if e.type == "response.reasoning_summary_text.delta"
        ]
        final = await stream.get_final_response()
    item = final.output[0]
    assert item.type == "reasoning" and item.content is not None
    assert [s.text for s in item.summary] == ["".join(summaries)] == [item.content[0].text]
