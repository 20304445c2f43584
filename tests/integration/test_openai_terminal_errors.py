"""How a request that never started reaches OpenAI-format clients over HTTP.

Real Redis and a real uvicorn server, no worker process: a request nobody starts within the
start timeout answers Chat and Responses with a 503 and ``Retry-After`` (as Anthropic's 529
does) and says ``retryable: true`` in the body; a request cancelled before any worker started
it (the worker's ``Error(cancelled)``, run here with the real job function) is a 499 on Chat,
never a 500, and a Response with status ``cancelled``.
"""

from __future__ import annotations

import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis

from services.worker.job_function import WorkerContext, run_job
from services.worker.scripted import parse_spec
from shared import keys
from shared.codec import decode_job
from shared.config import Settings
from shared.model_card import ModelCard
from tests.integration.server_harness import running_api

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_unstarted_chat_and_responses_are_503_with_retry_after(
    settings: Settings, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    quick = msgspec.structs.replace(settings, start_timeout_s=0.5)
    async with running_api(quick) as base, httpx.AsyncClient(base_url=base, timeout=10) as http:
        chat = await http.post(
            "/v1/chat/completions", json={"model": "tiny-test", "messages": MESSAGES}
        )
        resp = await http.post("/v1/responses", json={"model": "tiny-test", "input": "hi"})
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(model="tiny-test", messages=MESSAGES)  # type: ignore[arg-type]
        await client.close()
    for response in (chat, resp):
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert (error["code"], error["retryable"]) == ("overloaded", True)
    # the SDK keeps the error object as APIError.body: retryable is readable there
    assert raised.value.status_code == 503
    assert isinstance(raised.value.body, dict) and raised.value.body["retryable"] is True


async def test_cancelled_before_start_is_cancelled_not_500(
    api: str, settings: Settings, tiny_model: ModelCard, redis: aioredis.Redis
) -> None:
    async with httpx.AsyncClient(base_url=api, timeout=10) as http:
        body = {"model": "tiny-test", "messages": MESSAGES, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as chat:
            chat_id = chat.headers["x-request-id"]  # then the client leaves
        resp = await http.post(
            "/v1/responses", json={"model": "tiny-test", "input": "hi", "background": True}
        )
        resp_id = resp.json()["id"]
        cancel = await http.post(f"/v1/responses/{resp_id}/cancel")
        await redis.set(keys.cancel(chat_id), b"1")  # what a disconnect's cancel leaves behind
        # a worker then takes each job: the flag is up, so it publishes Error(cancelled)
        backend = parse_spec("scripted:text?rate=0", "tiny-test")
        wc = WorkerContext(
            settings=settings, redis=redis, backend=backend, name="tiny-test", wid="w"
        )
        for rid in (chat_id, resp_id):
            await run_job(wc, decode_job(await redis.hget(keys.request(rid), "job")))  # type: ignore[misc]
        chat_got = await http.get(f"/v1/chat/completions/{chat_id}")
        resp_got = await http.get(f"/v1/responses/{resp_id}")
    assert cancel.status_code == 200, cancel.text
    assert chat_got.status_code == 499, chat_got.text
    error = chat_got.json()["error"]
    assert (error["code"], error["type"], error["retryable"]) == (
        "cancelled",
        "invalid_request_error",
        False,
    )
    body = resp_got.json()
    assert (body["status"], body["error"], body["output"]) == ("cancelled", None, [])
