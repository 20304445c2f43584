"""Agent sessions: many multi-turn chats sharing one long system prompt, against sluice, an
older sluice and llama.cpp's llama-server, each alone on the machine in turn.

Per level S (``--sessions``, default 4,16,32): S concurrent sessions of ``--turns`` (6) streaming
``/v1/chat/completions`` requests. All share one ~3,000-token system prompt (words from a fixed
seed) and 7 function tools in ``tools``; each turn adds ~250 tokens of its own (a user request,
on odd turns a tool result) and asks for 128 tokens, greedy, EOS ignored; the answer goes back
verbatim as the assistant message of the next turn. Per server and S, client side: TTFT (send to
first content delta) p50/p90 of turn 1 and of turns 2+, median session wall time, output tok/s
(completion tokens over the level's wall time), turn-2+ cached tokens as the server reports them
(``usage.prompt_tokens_details.cached_tokens``, both servers; else llama-server's
``timings.cache_n``) as a share of the prompt (each turn's ~250 new tokens keep it under ~94%)
and of what the server had seen of the session (last prompt + answer: 100% when nothing was
lost), and peak RSS (VmHWM: sluice's worker, llama-server). ``--sluice-env`` sets variables of
both sluice stacks (e.g. SLUICE_MAX_BATCH=32; the default batch is 16). ``--workers N`` runs
this tree's sluice as N worker processes of ``--worker-threads`` each (``sluice_workers.py``) and
adds each worker's pickups by cache-affinity outcome; ``--sluice-env SLUICE_AFFINITY_WAIT_MS=0``
turns cache-aware pickup off.

Servers, started afresh per level: "sluice", this work tree's ``sluice up`` (as ``vs_server.py``
runs it, but as ``python -m services.cli`` from the tree's root, so another checkout can serve);
"sluice-before", the same from a git worktree of ``--before-ref`` at ``--before-dir`` (added
when missing); "llama-server" with its defaults but ``-np S -t THREADS -c S*8192``
(``cache_prompt`` is on by default). SmolLM2's template ignores ``tools``: with the default model
they add no prompt tokens on either server, and neither parses tool calls from the output.

``--chunked`` measures decode stalls instead: 8 streams of 256 tokens (short distinct prompts);
once each has 16 tokens out, a ~6,000-token prompt arrives. Per server: the streams' inter-chunk
interval median, p99 and max, and whether p99 < 3x median (sluice with
SLUICE_STREAM_INTERVAL_S=0: a chunk per decode step; the tokens/chunk column checks that).

    .venv/bin/python -m ops.bench.agent_sessions --before-ref HEAD~5 --json /tmp/agent.json
    .venv/bin/python -m ops.bench.agent_sessions --chunked --skip-before
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from ops.bench.agent_report import summarize, summarize_chunked
from ops.bench.agent_workload import LONG_WORDS, request, system_prompt, turn_text, words
from ops.bench.machine_load import emit, load_probe
from ops.bench.sluice_workers import sluice_workers, summarize_workers, worker_counts
from ops.bench.vs_server import _open, cmdline, descendants, free_port, stop, vm_hwm, wait_until

ROOT = Path(__file__).resolve().parents[2]


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], going: asyncio.Event | None = None
) -> dict[str, Any]:
    """One streaming request: TTFT, each content chunk's arrival time, the text, usage, timings.
    ``going`` is set after the 16th content chunk (or the end)."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    seen: dict[str, Any] = {"usage": {}, "timings": {}}  # the last of each (llama: timings)
    r, _ = await _open(client, url, body)
    try:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
            seen |= {k: chunk[k] for k in seen if chunk.get(k)}
            for c in chunk.get("choices", []):
                if piece := (c.get("delta") or {}).get("content"):
                    arrivals.append(time.perf_counter())
                    text.append(piece)
                    if going and len(arrivals) == 16:
                        going.set()
    finally:
        await r.aclose()
        if going:
            going.set()
    ttft = arrivals[0] - sent if arrivals else float("nan")
    return {"ttft": ttft, "arrivals": arrivals, "text": "".join(text), **seen,
            "end": time.perf_counter()}  # fmt: skip


def cached(usage: dict[str, Any], timings: dict[str, Any]) -> tuple[int, int] | None:
    """(cached prompt tokens, prompt tokens) as the server reported them, None if it did not."""
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"]), int(usage["prompt_tokens"])
    if "cache_n" in timings:  # llama-server: prompt_n counts only the tokens it computed
        return int(timings["cache_n"]), int(timings["cache_n"]) + int(timings["prompt_n"])
    return None


async def session(
    client: httpx.AsyncClient, url: str, model: str, s: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": system_prompt()}]
    turns, seen = [], 0  # seen: the tokens of the session the server has had (prompt + answer)
    for t in range(args.turns):
        messages.append({"role": "user", "content": turn_text(s, t)})
        r = await stream_chat(client, url, request(model, messages, args.tokens))
        messages.append({"role": "assistant", "content": r["text"]})
        hit = cached(r["usage"], r["timings"])
        usage = r["usage"]
        turns.append({"session": s, "turn": t, "ttft": r["ttft"], "end": r["end"], "cache": hit,
                      "seen": seen, "prompt_tokens": usage.get("prompt_tokens"),
                      "completion_tokens": int(usage.get("completion_tokens", 0))})  # fmt: skip
        seen = int(usage.get("prompt_tokens", 0)) + turns[-1]["completion_tokens"]
    return turns


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile, interpolated (0.5: the median)."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(100 * q) - 1]


async def sessions_level(base: str, model: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        began = time.perf_counter()
        done = await asyncio.gather(
            *(session(client, url, model, s, args) for s in range(n)), return_exceptions=True
        )
    errors = [repr(d) for d in done if isinstance(d, BaseException)]
    turns = [t for d in done if not isinstance(d, BaseException) for t in d]
    first = [t["ttft"] for t in turns if t["turn"] == 0]
    later = [t["ttft"] for t in turns if t["turn"] > 0]
    hits = [(*t["cache"], t["seen"]) for t in turns if t["turn"] > 0 and t["cache"]]
    walls = [d[-1]["end"] - began for d in done if not isinstance(d, BaseException)]
    row: dict[str, Any] = {
        "sessions": n,
        "errors": errors,
        "turn1_prompt_tokens": statistics.median(
            [t["prompt_tokens"] or 0 for t in turns if t["turn"] == 0] or [0]
        ),
        **{f"ttft{k}_p{q}": pct(v, q / 100) for k, v in ((1, first), (2, later)) for q in (50, 90)},
        "session_wall_p50": statistics.median(walls) if walls else float("nan"),
        "out_tok_s": sum(t["completion_tokens"] for t in turns) / (time.perf_counter() - began),
        # Of the prompt: new text is never cached, so ~94% at most with 6 turns of these sizes;
        # of what the server had seen of the session (the last prompt and answer): ~100% at best.
        "cached_share": sum(h[0] for h in hits) / sum(h[1] for h in hits) if hits else None,
        "cached_of_seen": sum(h[0] for h in hits) / sum(h[2] for h in hits) if hits else None,
    }
    return row | {"turns": turns}


def gaps(runs: list[list[float]], lo: float = 0.0, hi: float = float("inf")) -> list[float]:
    """Intervals between consecutive chunks of each stream that overlap ``(lo, hi)``."""
    return [b - a for r in runs for a, b in itertools.pairwise(r) if b > lo and a < hi]


async def chunked_level(base: str, model: str) -> dict[str, Any]:
    """8 decoding streams; a ~6,000-token prompt arrives once each has 16 chunks out."""
    url = f"{base}/v1/chat/completions"
    going = [asyncio.Event() for _ in range(8)]
    async with httpx.AsyncClient(timeout=900) as client:
        streams = [
            asyncio.create_task(stream_chat(client, url, request(
                model, [{"role": "user", "content": words(f"short-{i}", 30)}], 256, tools=False
            ), going[i]))
            for i in range(8)
        ]  # fmt: skip
        await asyncio.gather(*(g.wait() for g in going))
        long_body = request(model, [{"role": "user", "content": words("long", LONG_WORDS)}], 8)
        long_sent = time.perf_counter()
        long = await stream_chat(client, url, long_body)
        runs = await asyncio.gather(*streams)
    arrivals = [r["arrivals"] for r in runs]
    every = gaps(arrivals)
    p50, p99 = statistics.median(every), pct(every, 0.99)
    during = gaps(arrivals, long_sent, long_sent + long["ttft"])
    return {
        "streams": len(runs),
        "tokens_per_chunk": sum(r["usage"].get("completion_tokens", 0) for r in runs)
        / sum(map(len, arrivals)),
        "interval_p50": p50,
        "interval_p99": p99,
        "interval_max": max(every),
        "p99_under_3x_p50": p99 < 3 * p50,
        "long_prompt_tokens": long["usage"].get("prompt_tokens"),
        "long_ttft": long["ttft"],
        "during_long_max": max(during, default=float("nan")),
    }


@contextmanager
def sluice(root: Path, gguf: Path, extra: dict[str, str], log: Path) -> Iterator[tuple[Any, ...]]:
    """``sluice up`` from the tree at ``root``: (base URL, model id, its pids, the worker's)."""
    port = free_port()
    env = {**os.environ, "SLUICE_PORT": str(port), "SLUICE_HOST": "127.0.0.1", **extra}
    # Nothing answers there: `sluice up` starts its private Redis, as on a fresh machine.
    env["SLUICE_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    # The tree's root as cwd and first on the path (the children inherit both): its services
    # package, not the one the venv's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", str(gguf)]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        listed = wait_until(
            f"{base}/v1/models", lambda r: r.status_code == 200 and r.json()["data"], 300, proc
        )
        model = listed[0]["id"]
        kids = descendants(proc.pid)
        worker = next(p for p in kids if " worker" in cmdline(p))
        yield base, model, [proc.pid, *kids], worker
    finally:
        stop(proc)


@contextmanager
def llama(args: argparse.Namespace, gguf: Path, slots: int, log: Path) -> Iterator[tuple[Any, ...]]:
    """llama-server with its defaults but for slots, threads and context: as ``sluice``."""
    port = free_port()
    cmd = [args.llama_server, "-m", str(gguf), "-np", str(slots), "-t", str(args.threads)]
    cmd += ["-c", str(slots * args.ctx_per_slot), "--host", "127.0.0.1", "--port", str(port)]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(f"{base}/health", lambda r: r.status_code == 200, 300, proc)
        yield base, "any", [proc.pid], proc.pid
    finally:
        stop(proc)


def before_tree(ref: str, path: Path) -> Path:
    """A detached git worktree of ``ref`` at ``path``: added when missing, else checked out."""
    if (path / ".git").exists():
        git = ["git", "-C", str(path), "checkout", "-q", "--detach", ref]
    else:
        git = ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), ref]
    subprocess.run(git, check=True)
    return path


async def warm_up(base: str, model: str) -> None:
    """A short unrelated request first: kernels built, pages in, nothing of the prompts cached."""
    warm = request(model, [{"role": "user", "content": "Say hello."}], 8, tools=False)
    async with httpx.AsyncClient(timeout=300) as client:
        await stream_chat(client, f"{base}/v1/chat/completions", warm)


def measure(args: argparse.Namespace, name: str, gguf: Path, n: int) -> dict[str, Any]:
    """One server started afresh, warmed up, measured at one level, its peak RSS, stopped."""
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = args.log_dir / f"{name}-{'chunked' if args.chunked else n}.log"
    extra = dict(kv.split("=", 1) for kv in args.sluice_env)
    if args.chunked:  # one decode step per SSE chunk, so chunk gaps are step gaps
        extra["SLUICE_STREAM_INTERVAL_S"] = "0"
    root = args.before_dir if name == "sluice-before" else ROOT
    slots = n + 1 if args.chunked else n
    server = (
        llama(args, gguf, slots, log) if name == "llama-server" else sluice(root, gguf, extra, log)
    )
    if name == "sluice" and args.workers:  # N worker processes instead of `sluice up`'s one
        threads = args.worker_threads or max(1, (os.cpu_count() or 1) // args.workers)
        server = sluice_workers(root, gguf, extra, log, args.workers, threads)
    row: dict[str, Any] = {
        "server": name,
        "sessions": n,
        "log": str(log),
        "affinity_wait_ms": extra.get("SLUICE_AFFINITY_WAIT_MS", "default"),
    }
    with server as (base, model, pids, rss_pid, *metrics):
        asyncio.run(warm_up(base, model))
        with load_probe(pids, row):
            if args.chunked:
                row |= asyncio.run(chunked_level(base, model))
            else:
                row |= asyncio.run(sessions_level(base, model, n, args))
        row["peak_rss_bytes"] = vm_hwm(rss_pid)
        if metrics:  # per worker: jobs by affinity outcome, its prefix cache's share
            row["worker_counts"] = worker_counts(metrics[0])
    emit({k: v for k, v in row.items() if k != "turns"})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="4,16,32", help="levels S, comma-separated")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128, help="completion tokens per turn")
    p.add_argument("--model", type=Path, help="GGUF (default: the default model's file)")
    p.add_argument("--llama-server", default="/tmp/llama/llama-server")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    p.add_argument("--ctx-per-slot", type=int, default=8192, help="llama-server -c: S times it")
    p.add_argument("--before-ref", default="HEAD", help="sluice-before's commit")
    p.add_argument("--before-dir", type=Path, default=Path("/tmp/sluice-before"))
    p.add_argument("--skip-before", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument(
        "--sluice-env", action="append", default=[], metavar="KEY=VALUE",
        help="extra environment of both sluice stacks, e.g. SLUICE_MAX_BATCH=32 (repeatable)",
    )  # fmt: skip
    p.add_argument("--chunked", action="store_true", help="the decode-stall measurement instead")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="sluice as N `sluice worker` processes behind `sluice api` (0: `sluice up`)",
    )
    p.add_argument("--worker-threads", type=int, default=0,
                   help="SLUICE_THREADS of each of --workers (0: the cores / N)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write every row, per-turn numbers included")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/agent_sessions_logs"))
    args = p.parse_args()
    if args.model:
        gguf = args.model
    else:
        from services.worker.loaders import default_model_path

        gguf = default_model_path()
    names = ["sluice"]
    if not args.skip_before:
        before_tree(args.before_ref, args.before_dir)
        names.append("sluice-before")
    if not args.skip_llama:
        names.append("llama-server")
    emit({"machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
          "args": {k: str(v) for k, v in vars(args).items()}})  # fmt: skip
    levels = [8] if args.chunked else [int(x) for x in args.sessions.split(",")]
    rows = [measure(args, name, gguf, n) for n in levels for name in names]
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "rows": rows}, default=str, indent=1))
    (summarize_chunked if args.chunked else summarize)(rows)
    if args.workers:
        summarize_workers([r for r in rows if "worker_counts" in r])


if __name__ == "__main__":
    main()
