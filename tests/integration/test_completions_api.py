"""``/v1/completions``, ``/tokenize`` and ``/detokenize`` end to end: the official openai SDK's
``completions.create`` (streamed and not) -> real uvicorn -> Redis -> the scripted worker.

The scripted model's tokenizer is byte-level, so the default ``max_tokens`` of 16 cuts its reply
after 16 bytes: that is how the default shows. It has no FIM tokens, so ``suffix`` is its 400.
"""

from __future__ import annotations

import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis

from services.worker.scripted import build_tokenizer
from shared import keys
from shared.codec import decode_entries, decode_job
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

MODEL = "scripted-text"
REPLY = "Hello! This is a scripted reply from sluice's test double."


def client(api: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="k", max_retries=0)


async def test_create_returns_a_text_completion(
    api: str, worker: object, redis: aioredis.Redis
) -> None:
    async with client(api) as c:
        done = await c.completions.create(model=MODEL, prompt="Once upon a time")
    assert done.object == "text_completion" and done.id.startswith("cmpl_")
    choice = done.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == (REPLY[:16], "length", 0)
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (16, 16)
    job = decode_job(await redis.hget(keys.request(done.id), "job"))  # type: ignore[misc]
    assert job.raw_text and job.origin == "openai_completions" and job.messages == []
    assert job.prompt_token_ids == build_tokenizer().encode("Once upon a time").ids
    check_stream(decode_entries(await redis.xrange(keys.events(done.id))))


async def test_stream_matches_the_non_streamed_answer(api: str, worker: object) -> None:
    async with client(api) as c:
        whole = await c.completions.create(model=MODEL, prompt=["hi"], max_tokens=200, echo=True)
        stream = await c.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=200,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert whole.choices[0].text == "hi" + REPLY
    assert whole.choices[0].finish_reason == "stop"
    assert all(ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


async def test_stop_and_sampling_fields_reach_the_job(
    api: str, worker: object, redis: aioredis.Redis
) -> None:
    # The scripted worker ignores them (stops are the worker decoder's, unit-tested there).
    async with client(api) as c:
        done = await c.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=100,
            stop=["scripted"],
            temperature=0.5,
            top_p=0.9,
            seed=3,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            user="u",
        )
    job = decode_job(await redis.hget(keys.request(done.id), "job"))  # type: ignore[misc]
    s = job.sampling
    assert (job.stop, job.max_tokens, job.user) == (["scripted"], 100, "u")
    assert (s.temperature, s.top_p, s.seed, s.presence_penalty, s.frequency_penalty) == (
        0.5,
        0.9,
        3,
        0.1,
        0.2,
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["a", 5]}, "prompt[1]"),
        ({"prompt": "a", "n": 99}, "n"),  # over SLUICE_MAX_N
        ({"prompt": ["a"] * 2000}, "prompt"),  # more completions than the queue holds
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": "a", "logprobs": 99}, "logprobs"),
        ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ],
)
async def test_unsupported_requests_are_openai_400s(
    api: str, worker: object, fields: dict[str, object], param: str
) -> None:
    async with client(api) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model=MODEL, **fields)  # type: ignore[call-overload]
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert error["type"] == "invalid_request_error"


async def test_unknown_model_is_a_404_in_openai_s_shape(api: str, worker: object) -> None:
    async with client(api) as c:
        with pytest.raises(openai.NotFoundError) as info:
            await c.completions.create(model="nope", prompt="a")
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"


async def test_tokenize_and_detokenize(api: str, worker: object) -> None:
    tok = build_tokenizer()
    async with httpx.AsyncClient(base_url=api) as http:
        raw = (await http.post("/tokenize", json={"model": MODEL, "prompt": "hi there"})).json()
        assert raw == {
            "count": 8,
            "max_model_len": 4096,
            "tokens": tok.encode("hi there").ids,
            "token_strs": None,
        }
        chat = await http.post(
            "/tokenize",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        text = tok.decode(chat.json()["tokens"], skip_special_tokens=False)
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        bare = await http.post(
            "/tokenize",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "add_generation_prompt": False,
            },
        )
        assert bare.json()["count"] == chat.json()["count"] - len(
            tok.encode("<|im_start|>assistant\n").ids
        )
        back = await http.post("/detokenize", json={"model": MODEL, "tokens": raw["tokens"]})
        assert back.json() == {"prompt": "hi there"}


async def test_tokenize_errors_are_openai_s(api: str, worker: object) -> None:
    async with httpx.AsyncClient(base_url=api) as http:
        cases = [
            ("/tokenize", {"model": MODEL}, 400, "prompt"),
            ("/tokenize", {"model": MODEL, "prompt": 3}, 400, "prompt"),
            ("/tokenize", {"model": "nope", "prompt": "a"}, 404, None),
            ("/detokenize", {"model": MODEL, "tokens": [10**9]}, 400, "tokens[0]"),
            ("/detokenize", {"model": MODEL}, 400, None),
        ]
        for path, body, status, param in cases:
            answer = await http.post(path, content=msgspec.json.encode(body))
            assert answer.status_code == status, (path, body, answer.text)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code", "retryable"}
            if param is not None:
                assert error["param"] == param
