"""Reliability figures: streams tried, survived and lost across Redis restarts and worker kills.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python -m ops.bench.chaos                 # 5 rounds of each scenario
    .venv/bin/python -m ops.bench.chaos --rounds 10 --streams 8

Every round starts real processes (a private ``redis-server`` on a unix socket, ``sluice worker``
serving the scripted test double, ``sluice api``; the helpers in ``tests/chaos/procs.py``), runs
streaming chat requests whose exact text is known (the same request answered without chaos),
and then:

* ``redis-aof`` / ``redis-no-aof``: SIGKILLs Redis once every stream has text, restarts it 0.8 s
  later (with its append-only file, ``appendfsync always``, or empty);
* ``worker-kill``: SIGKILLs the worker serving all of them while a second worker is idle, then
  times a new request from the kill to its last chunk and counts arq entries left behind;
* ``redis-oom``: fills Redis to its ``maxmemory`` (``noeviction``) with a filler key once every
  stream has text, holds it full for ``--oom-hold`` seconds (8) while a client keeps sending new
  requests (their statuses are counted: 503 is the answer), then deletes the filler.

Each stream ends as ``exact`` (the full answer, identical to the reference), ``error`` (a
retryable error frame, then the format's end), ``wrong`` (ended with other text) or ``hung``
(no end within 30 s of the restart). ``wait`` is the longest time from the restart (or the
kill) to a stream's end. Not a test: it prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.chaos.procs import RedisServer, Service, free_port, wait_http
from tests.chaos.sse_reader import ChatStream, read_chat

ENV = {
    "SLUICE_HEARTBEAT_S": "0.2",
    "SLUICE_LEASE_TTL_S": "1.5",
    "SLUICE_KEEPALIVE_S": "0.5",
    "SLUICE_THREADS": "1",
    "SLUICE_LOG_LEVEL": "warning",
}
SPEC = "scripted:long?rate=100"
BODY = {
    "model": "scripted-long",
    "messages": [{"role": "user", "content": "go"}],
    "max_tokens": 200,
    "stream": True,
}
HANG_S = 30.0
OOM_HEADROOM = 4 * 1024 * 1024  # maxmemory above what the idle stack uses
OOM_PIECE = 256 * 1024  # the filler grows by this until Redis refuses it


class Stack:
    """Redis, workers and one API for one round."""

    def __init__(self, aof: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sluice-chaos-"))
        self.redis = RedisServer(self.dir, aof=aof)
        self.redis.start()
        self.env = {**ENV, "SLUICE_REDIS_URL": self.redis.url}
        self.workers: list[Service] = []
        self.add_worker()
        port = free_port()
        self.api = Service(["api", "--port", str(port)], self.env, self.dir / "api.log")
        self.base = f"http://127.0.0.1:{port}"
        wait_http(f"{self.base}/readyz")

    def add_worker(self) -> Service:
        log = self.dir / f"worker{len(self.workers)}.log"
        worker = Service(["worker", "--model", SPEC], self.env, log)
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for service in [*self.workers, self.api]:
            service.kill()
        self.redis.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def verdict(got: ChatStream | BaseException, expected: str) -> str:
    if isinstance(got, BaseException):
        return "hung"
    if got.error is not None and got.done:
        return "error"
    return "exact" if got.done and got.text == expected else "wrong"


async def streams_through(
    stack: Stack, n: int, chaos: object
) -> tuple[list[ChatStream | BaseException], float]:
    """Run ``n`` streams, call ``chaos()`` once all have text; (results, time of the chaos)."""
    ready = asyncio.Event()
    seen = 0
    when: list[float] = []

    def one() -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            ready.set()

    async with httpx.AsyncClient(timeout=HANG_S * 2) as client:

        async def run() -> ChatStream:
            return await asyncio.wait_for(
                read_chat(client, stack.base, BODY, after_chunks=3, hook=one), HANG_S * 2
            )

        tasks = [asyncio.create_task(run()) for _ in range(n)]
        await asyncio.wait_for(ready.wait(), 60)
        await chaos()  # type: ignore[operator]
        when.append(time.monotonic())
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return list(results), when[0]


async def redis_round(aof: bool, n: int, expected: str) -> tuple[Counter[str], float]:
    stack = Stack(aof)
    try:

        async def outage() -> None:
            stack.redis.kill()
            await asyncio.sleep(0.8)
            stack.redis.start()

        results, restarted = await streams_through(stack, n, outage)
        ends = [r.ended_at - restarted for r in results if isinstance(r, ChatStream)]
        return Counter(verdict(r, expected) for r in results), max(ends, default=float("nan"))
    finally:
        stack.close()


async def kill_round(n: int, expected: str) -> tuple[Counter[str], float, float, int]:
    stack = Stack(aof=False)
    try:
        victim = stack.workers[0]
        stack.add_worker()
        killed: list[float] = []
        done = asyncio.Event()

        async def kill() -> None:
            victim.kill()
            killed.append(time.monotonic())
            done.set()

        async with httpx.AsyncClient(timeout=HANG_S) as client:
            waiting = asyncio.create_task(streams_through(stack, n, kill))
            await done.wait()
            fresh = await read_chat(client, stack.base, {**BODY, "max_tokens": 5})
            fresh_s = fresh.ended_at - killed[0]
            results, _ = await waiting
        await asyncio.sleep(3.0)  # a few sweeps
        r = stack.redis.client()
        queued: int = r.zcard("sluice:queue:scripted-long")  # type: ignore[assignment]
        running: list[bytes] = r.keys("arq:in-progress:*")  # type: ignore[assignment]
        left = queued + len(running)
        ends = [x.ended_at - killed[0] for x in results if isinstance(x, ChatStream)]
        verdicts = Counter(verdict(x, expected) for x in results)
        return verdicts, max(ends, default=float("nan")), fresh_s, left
    finally:
        stack.close()


async def oom_round(
    n: int, expected: str, hold_s: float
) -> tuple[Counter[str], float, Counter[int]]:
    """``n`` streams through a Redis held full for ``hold_s``; (verdicts, longest wait after
    memory was freed, statuses of the new requests sent meanwhile)."""
    stack = Stack(aof=False)
    statuses: Counter[int] = Counter()
    try:
        admin = stack.redis.client()
        memory: dict[str, Any] = admin.info("memory")  # type: ignore[assignment]
        used = int(memory["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", used + OOM_HEADROOM)

        async def fill_hold_free() -> None:
            for _ in range(4 * OOM_HEADROOM // OOM_PIECE):
                try:
                    admin.append("filler", b"x" * OOM_PIECE)
                except Exception:  # redis' OutOfMemoryError: full
                    break
            # Hold it full: expiring and trimmed entries free a little memory now and then, and
            # just past the limit Redis would take some writes again
            full: dict[str, Any] = admin.info("memory")  # type: ignore[assignment]
            admin.config_set("maxmemory", int(full["used_memory"]) // 2)
            ends = time.monotonic() + hold_s
            async with httpx.AsyncClient(timeout=HANG_S) as client:
                while time.monotonic() < ends:
                    body = {**BODY, "stream": False, "max_tokens": 5}
                    reply = await client.post(f"{stack.base}/v1/chat/completions", json=body)
                    statuses[reply.status_code] += 1
                    await asyncio.sleep(0.5)
            admin.delete("filler")
            admin.config_set("maxmemory", used + OOM_HEADROOM)

        results, freed = await streams_through(stack, n, fill_hold_free)
        ends = [r.ended_at - freed for r in results if isinstance(r, ChatStream)]
        verdicts = Counter(verdict(r, expected) for r in results)
        return verdicts, max(ends, default=float("nan")), statuses
    finally:
        stack.close()


async def reference() -> str:
    stack = Stack(aof=False)
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            return (await read_chat(client, stack.base, BODY)).text
    finally:
        stack.close()


def row(name: str, n: int, verdicts: Counter[str], wait: float, extra: str = "") -> str:
    lost = verdicts["hung"] + verdicts["wrong"]
    return (
        f"| {name} | {n} | {verdicts['exact']} | {verdicts['error']} | {lost} | {wait:.1f} s"
        f" | {extra} |"
    )


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--oom-hold", type=float, default=8.0, help="seconds Redis stays full")
    p.add_argument("--only", choices=["redis", "kill", "oom"], default=None)
    args = p.parse_args()
    expected = await reference()
    print("| scenario | streams tried | survived (exact text) | clear retryable error |"
          " lost (hung or wrong) | longest wait after the fault | notes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for aof in (True, False) if args.only in (None, "redis") else ():
        total: Counter[str] = Counter()
        worst = 0.0
        for _ in range(args.rounds):
            verdicts, wait = await redis_round(aof, args.streams, expected)
            total += verdicts
            worst = max(worst, wait)
        name = "Redis SIGKILL + restart, AOF" if aof else "Redis SIGKILL + restart, no AOF"
        print(row(name, args.rounds * args.streams, total, worst), flush=True)
    total = Counter()
    worst = fresh_worst = 0.0
    leftovers = 0
    for _ in range(args.rounds if args.only in (None, "kill") else 0):
        verdicts, wait, fresh_s, left = await kill_round(16, expected)
        total += verdicts
        worst, fresh_worst = max(worst, wait), max(fresh_worst, fresh_s)
        leftovers += left
    if args.only in (None, "kill"):
        note = f"new request done {fresh_worst:.1f} s after the kill; arq entries left: {leftovers}"
        print(row("worker SIGKILL, 16 in flight", args.rounds * 16, total, worst, note))
    if args.only in (None, "oom"):
        total = Counter()
        statuses: Counter[int] = Counter()
        worst = 0.0
        for _ in range(args.rounds):
            verdicts, wait, seen = await oom_round(16, expected, args.oom_hold)
            total += verdicts
            worst = max(worst, wait)
            statuses += seen
        note = "new requests meanwhile: " + ", ".join(
            f"{n} x {code}" for code, n in sorted(statuses.items())
        )
        name = f"Redis full ({args.oom_hold:.0f} s, noeviction), 16 in flight"
        print(row(name, args.rounds * 16, total, worst, note), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
