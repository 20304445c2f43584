"""Codex CLI and Claude Code, the real programs with their default settings, against sluice.

A real uvicorn API and a real worker on the test Redis; the clients run as subprocesses that can
only reach 127.0.0.1 (``real_clients``). Codex asks for a model id from its own catalog, so it
sends everything it sends to OpenAI (a ``custom`` apply_patch tool with a lark grammar, client
``tool_search``, a hosted ``web_search``, ``reasoning``, ``include``, ``text.verbosity``). The
worker behind that id is the scripted test double, not the default model: Codex sends no
``max_output_tokens``, and SmolLM2 sampling freely can write thousands of tokens (a full-suite
run on a loaded 2-core box took over four minutes and Codex's stream gave up), while the point
here is the wire, which the double exercises through the real tokenizer, template and API.
A short instructions file keeps the prompt brief all the same. Claude Code asks for
``max_tokens: 32000`` whatever the model: the scripted worker's card advertises a context that
holds its ~50k-token prompt but not that much output, so the first request is refused with
Anthropic's wording and Claude Code must retry by itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.codec import decode_job
from shared.config import Settings
from shared.jobs import Job
from tests.conformance.real_clients import (
    CLAUDE_CODE,
    CODEX,
    claude_env,
    client_bin,
    codex_config,
)
from tests.integration.server_harness import running_api
from tests.integration.worker_harness import running_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CODEX_MODEL = "gpt-5.5"  # in Codex 0.169's model catalog
CLAUDE_MODEL = "scripted-text"
CLIENT_TIMEOUT_S = 240.0


@pytest.fixture
async def api(redis_url: str, redis: aioredis.Redis) -> AsyncIterator[str]:
    settings = Settings(redis_url=redis_url, keepalive_s=0.5)
    async with running_api(settings) as base_url:
        yield base_url


async def _run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    # Asynchronous, so the in-process worker keeps running on this loop meanwhile.
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLIENT_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        pytest.fail(f"{argv[0]} did not finish: {out.decode()[-3000:]} {err.decode()[-3000:]}")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_codex_exec_completes_a_turn(api: str, redis_url: str, tmp_path: Path) -> None:
    codex = client_bin(CODEX)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = codex_config(home, f"{api}/v1", CODEX_MODEL, "You are a terse assistant.")
    # Byte-level tokens: Codex's prompt with its tools is ~40k of them.
    async with running_worker(redis_url, "scripted:text?rate=0&ctx=100000", name=CODEX_MODEL):
        argv = [str(codex), "exec", "--json", "--skip-git-repo-check", "Say hello in one word."]
        code, out, err = await _run(argv, env, work)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert code == 0, f"codex exited {code}: {out[-3000:]} {err[-3000:]}"
    assert kinds[-1] == "turn.completed", kinds
    assert "turn.failed" not in kinds and "error" not in kinds, out[-3000:]
    messages = [e["item"] for e in events if e.get("type") == "item.completed"]
    assert any(m.get("type") == "agent_message" and m.get("text") for m in messages), messages


async def _admitted_jobs(redis: aioredis.Redis) -> list[Job]:
    return [
        decode_job(await redis.hget(key, "job"))
        async for key in redis.scan_iter(match=keys.request("*"))
    ]


async def test_claude_code_print_mode_recovers_from_its_default_max_tokens(
    api: str, redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    claude = client_bin(CLAUDE_CODE)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = claude_env(home, api, CLAUDE_MODEL)
    # ~50k byte tokens of prompt fit; 32000 more do not.
    async with running_worker(redis_url, "scripted:text?rate=0&ctx=70000"):
        argv = [str(claude), "-p", "Say hello.", "--output-format", "json"]
        code, out, err = await _run(argv, env, work)
    assert code == 0, f"claude exited {code}: {out[-3000:]} {err[-3000:]}"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["is_error"] is False, result
    assert result["result"], result
    # Its first request asked for 32000 tokens (refused, nothing stored); every request that
    # got through asked for what fits, so Claude Code read the numbers out of the 400.
    admitted = await _admitted_jobs(redis)
    assert admitted
    for job in admitted:
        assert job.max_tokens is not None and job.max_tokens < 32000
        assert len(job.prompt_token_ids) + job.max_tokens <= 70000
