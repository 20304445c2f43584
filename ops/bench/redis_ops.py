"""Redis operations and SSE frames per generated token, end to end.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python -m ops.bench.redis_ops                  # private redis-server, defaults
    .venv/bin/python -m ops.bench.redis_ops --streams 8 --slow-s 1.0

Starts a private ``redis-server`` (unix socket, so nobody else's traffic is counted), a real
``sluice worker`` serving the scripted double ``scripted:long`` (600 words, no rate limit: steps
come as fast as the worker publishes them, like a fast GPU) and a real ``sluice api``, then runs
``--streams`` concurrent streaming chat completions twice:

* fast clients read as the events come;
* slow clients read nothing for ``--slow-s`` seconds after the headers, then read everything
  (what the API coalesces while a client is behind).

For each run it reports, per generated token (``usage.completion_tokens`` summed): Redis
commands from ``INFO commandstats`` deltas (all of them, and the ones that matter: EVALSHA, the
XADDs run inside the publish script, the API's XREADs), stream entries written, and SSE
``data:`` frames the clients received. Not a test: it prints a Markdown table for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from ops.bench.stream_nodes import start_redis
from ops.bench.streams import free_port

MODEL = "bench-ops"
SPEC = "scripted:long?max_batch=64"
WATCHED = ("evalsha", "xadd", "xread", "expire", "get", "mget", "exists", "hset", "set")


async def commandstats(redis: aioredis.Redis) -> dict[str, int]:
    info = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


async def one_stream(client: httpx.AsyncClient, i: int, slow_s: float) -> tuple[int, int]:
    """One streaming chat completion; returns (completion tokens, data frames)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"go {i}"}],
        "stream": True,
        "max_tokens": 1000,
        "stream_options": {"include_usage": True},
    }
    frames, tokens = 0, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        if slow_s:
            await asyncio.sleep(slow_s)  # the server keeps producing; the socket buffers fill
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frames += 1
            if '"usage":{' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
    return tokens, frames


async def run(redis: aioredis.Redis, base: str, n: int, slow_s: float) -> dict[str, float]:
    before = await commandstats(redis)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        results = await asyncio.gather(*(one_stream(client, i, slow_s) for i in range(n)))
    await asyncio.sleep(0.5)  # the worker's release/cleanup after the terminal event
    after = await commandstats(redis)
    tokens = sum(t for t, _ in results)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    out = {"tokens": float(tokens), "frames": sum(f for _, f in results) / tokens}
    out["all"] = sum(delta.values()) / tokens
    # The scripted double emits a word (several tokens) per step; a model emits one token per
    # step, so per-step figures (stream entries written by the publish script) matter too.
    steps = delta.get("xadd", 0) or 1
    out["step"] = sum(delta.values()) / steps
    out["tokens_per_step"] = tokens / steps
    for name in WATCHED:
        out[name] = delta.get(name, 0) / tokens
    top = sorted(delta.items(), key=lambda kv: -kv[1])[:10]
    print("  per entry: " + ", ".join(f"{k} {v / steps:.2f}" for k, v in top), file=sys.stderr)
    return out


def start_stack(url: str, port: int) -> list[subprocess.Popen[bytes]]:
    """A scripted ``sluice worker`` and a ``sluice api`` on ``url``, once the API is ready."""
    env = {**os.environ, "SLUICE_REDIS_URL": url, "SLUICE_LOG_LEVEL": "warning"}
    env["SLUICE_PORT"] = str(port)
    cmd = [sys.executable, "-m", "services.cli"]
    procs = [
        subprocess.Popen([*cmd, "worker", "--model", SPEC, "--name", MODEL], env=env),
        subprocess.Popen([*cmd, "api"], env=env),
    ]
    for _ in range(1200):  # /readyz answers 200 once a worker's card is published
        try:
            httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).raise_for_status()
            return procs
        except httpx.HTTPError:
            time.sleep(0.05)
    sys.exit("redis_ops.py: the API never became ready")


async def measure(url: str, port: int, streams: int, slow_s: float) -> None:
    redis = aioredis.Redis.from_url(url)
    base = f"http://127.0.0.1:{port}"
    try:
        await run(redis, base, 1, 0.0)  # warm-up: script loads, connections
        cols = " | ".join(f"{c}/token" for c in WATCHED)
        head = "| clients | tokens | tokens/entry | SSE frames/token | Redis cmds/token "
        head += f"| cmds/entry | {cols} |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for label, slow in (("fast", 0.0), (f"slow ({slow_s:g} s)", slow_s)):
            r = await run(redis, base, streams, slow)
            cells = " | ".join(f"{r[c]:.2f}" for c in WATCHED)
            print(
                f"| {streams} {label} | {r['tokens']:.0f} | {r['tokens_per_step']:.2f} "
                f"| {r['frames']:.2f} | {r['all']:.2f} | {r['step']:.2f} | {cells} |",
                flush=True,
            )
    finally:
        await redis.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--slow-s", type=float, default=1.0)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks below
    with tempfile.TemporaryDirectory(prefix="sluice-ops-") as tmp:
        server, url = start_redis(Path(tmp))
        port = free_port()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs = start_stack(url, port)
            asyncio.run(measure(url, port, args.streams, args.slow_s))
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(30)
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()
