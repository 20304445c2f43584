"""The whole stack against llama.cpp's own HTTP server, on one GGUF, as a new user runs each.

Ours: ``sluice up --model FILE`` with its defaults (API + a private Redis + one worker; the
launcher gives the worker every core). llama.cpp: ``llama-server -m FILE -np 16 -t 2
-fa off`` (16 slots, 2 threads, flash attention off). The servers run back to back on the same
cores, llama-server first, each under the same load: one load generator (this process) with C
concurrent clients (``--concurrency``, default 1 4 16), each sending ``--rounds`` streaming
``/v1/chat/completions`` requests in a row (default 4 at C=1, else 2): ~190-token prompts that
differ from their first words on (no prefix shared beyond the chat template's), greedy, EOS
ignored, 128 tokens out. ``--threads`` sets llama-server's ``-t`` (default 2).

Per server and C: output tok/s (completion tokens of all requests over the span from the first
send to the last byte), TTFT p50 (send to first content chunk, client side), and at C=1 the
prompt rate measured by each server: llama-server's ``timings`` (prompt_n / prompt_ms of the
non-cached prompt tokens), ours from the worker's Prometheus metrics (prompt tokens not served
from the prefix cache over ``sluice_request_prefill_time_seconds``: pickup to first token).
Peak RSS: VmHWM of the worker process and of llama-server after the last level. Every level
records the load average and the CPU that other processes used (``machine_load``).

``--llama-quantize PATH`` writes the files first: ``llama-quantize --allow-requantize SRC OUT
TYPE`` for each ``--types`` (default Q4_0 Q8_0 Q4_K_M) from the default model (Q4_1) into
``--out-dir``; the run then covers the default model and each of them. Never commit the files.

    .venv/bin/python -m ops.bench.vs_server --llama-server /tmp/llama/llama-server \
        --llama-quantize /tmp/llama/llama-quantize --out-dir /tmp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ops.bench.machine_load import emit, load_probe

TEXT = (
    "Describe in detail how a small river town changes over one year, covering the weather, "
    "the people who work on the water, the markets, the festivals, the schools and the old "
    "bridge that everyone crosses each morning. "
)
WORDS = ["amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo"]


def prompt(i: int) -> str:
    """Request ``i``'s user message: ~190 tokens once rendered, distinct from the first words."""
    lead = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4))
    return (
        f"Request {i} ({lead}). "
        + TEXT * 3
        + "Please answer in at least six paragraphs, and end with a short poem about it."
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vm_hwm(pid: int) -> int:
    """Peak resident set of a live process, bytes (0 when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(found.group(1)) * 1024 if found else 0


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc/*/stat parent ids)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            parents[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, par in parents.items() if par == p]
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def wait_until(url: str, check: Any, seconds: float, proc: subprocess.Popen[bytes]) -> Any:
    """Poll ``url`` until ``check(response)`` returns something truthy; return it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            got = check(httpx.get(url, timeout=5))
            if got:
                return got
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {seconds:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (sluice up stops its children on it), then SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _open(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[httpx.Response, int]:
    """Send the request; a connection the server closed before any response (llama-server does
    this now and then to a level's first request on 2-core VMs) is sent again, up to twice. The
    response and how many times it was resent; the retries' time counts against that server:
    ``sent`` was taken before the first try."""
    for attempt in range(3):
        try:
            request = client.build_request("POST", url, json=body)
            return await client.send(request, stream=True), attempt
        except httpx.RemoteProtocolError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def one(
    client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int
) -> dict[str, Any]:
    """One streaming chat request: send-to-first-content, end time, usage, server timings."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = 0.0
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    r, resent = await _open(client, url, body)
    try:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            if not first and any(
                c.get("delta", {}).get("content") for c in chunk.get("choices", [])
            ):
                first = time.perf_counter()
    finally:
        await r.aclose()
    end = time.perf_counter()
    return {"ttft": first - sent, "end": end, "usage": usage, "timings": timings, "resent": resent}


async def level(
    base: str, model: str, c: int, rounds: int, tokens: int, start: int
) -> dict[str, Any]:
    """C clients, ``rounds`` requests each; request ids from ``start`` (distinct prompts)."""
    url = f"{base}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:

        async def client_loop(k: int) -> list[dict[str, Any]]:
            return [
                await one(client, url, model, start + k * rounds + n, tokens) for n in range(rounds)
            ]

        began = time.perf_counter()
        done = await asyncio.gather(*(client_loop(k) for k in range(c)))
    runs = [r for rs in done for r in rs]
    out_tokens = sum(int(r["usage"].get("completion_tokens", 0)) for r in runs)
    span = max(r["end"] for r in runs) - began
    row: dict[str, Any] = {"concurrency": c, "requests": len(runs), "out_tokens": out_tokens}
    row["resent"] = sum(r["resent"] for r in runs)
    row["out_tok_s"] = out_tokens / span
    row["ttft_p50_ms"] = 1e3 * statistics.median(r["ttft"] for r in runs)
    row["prompt_tokens"] = statistics.median(int(r["usage"].get("prompt_tokens", 0)) for r in runs)
    rates = [r["timings"]["prompt_per_second"] for r in runs if r["timings"].get("prompt_n", 0) > 8]
    if rates:
        row["server_prompt_tok_s"] = statistics.median(rates)
        row["server_prompt_n"] = statistics.median(r["timings"]["prompt_n"] for r in runs)
    return row


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) in an exposition ``text``."""
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def measure(
    args: argparse.Namespace,
    name: str,
    base: str,
    model: str,
    pids: list[int],
    metrics_url: str | None,
) -> list[dict[str, Any]]:
    rows = []
    asyncio.run(level(base, model, 1, 1, 8, 10_000))  # warm-up: kernels built, pages in
    for i, c in enumerate(args.concurrency):
        before = httpx.get(metrics_url).text if metrics_url else ""
        row: dict[str, Any] = {"server": name, "file": Path(args.current).name}
        try:
            with load_probe(pids, row):
                rounds = args.rounds or max(2, -(-4 // c))  # C=1: 4 requests, else 2 rounds
                row |= asyncio.run(level(base, model, c, rounds, args.tokens, 1000 * (i + 1)))
        except httpx.HTTPError as exc:  # a server that dropped a stream: record it, go on
            emit({**row, "concurrency": c, "error": repr(exc)})
            continue
        if metrics_url and c == 1:  # our prefill, as the worker measured it
            after = httpx.get(metrics_url).text
            d = {k: metric(after, k) - metric(before, k) for k in (
                "sluice_prompt_tokens_total", "sluice_prefix_cache_hits_total",
                "sluice_request_prefill_time_seconds_sum")}  # fmt: skip
            fresh = d["sluice_prompt_tokens_total"] - d["sluice_prefix_cache_hits_total"]
            row["server_prompt_n"] = fresh / max(row["requests"], 1)
            row["server_prompt_tok_s"] = fresh / d["sluice_request_prefill_time_seconds_sum"]
        emit(row)
        rows.append(row)
    return rows


def run_llama(args: argparse.Namespace, gguf: Path) -> list[dict[str, Any]]:
    port = free_port()
    cmd = [args.llama_server, "-m", str(gguf), "-np", "16", "-t", str(args.threads), "-fa", "off"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(f"{base}/health", lambda r: r.status_code == 200, 300, proc)
        rows = measure(args, "llama-server", base, "any", [proc.pid], None)
        peak = {"server": "llama-server", "file": gguf.name, "concurrency": 0}
        peak["peak_rss_bytes"] = vm_hwm(proc.pid)
        emit(peak)
        return [*rows, peak]
    finally:
        stop(proc)


def run_sluice(args: argparse.Namespace, gguf: Path) -> list[dict[str, Any]]:
    port, mport = free_port(), free_port()
    env = {**os.environ, "SLUICE_PORT": str(port), "SLUICE_HOST": "127.0.0.1"}
    # Nothing answers there: `sluice up` starts its private Redis, as on a fresh machine.
    env["SLUICE_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    env["SLUICE_METRICS_PORT"] = str(mport)  # the worker's metrics: our prefill time
    sluice = str(Path(sys.executable).with_name("sluice"))
    proc = subprocess.Popen(
        [sluice, "up", "--model", str(gguf)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        model = wait_until(
            f"{base}/v1/models",
            lambda r: r.status_code == 200 and r.json()["data"] and r.json()["data"][0]["id"],
            300,
            proc,
        )
        kids = descendants(proc.pid)
        worker = next(p for p in kids if " worker" in cmdline(p))
        rows = measure(
            args, "sluice", base, model, [proc.pid, *kids], f"http://127.0.0.1:{mport}/metrics"
        )
        peak = {"server": "sluice", "file": gguf.name, "concurrency": 0}
        peak["peak_rss_bytes"] = vm_hwm(worker)
        emit(peak)
        return [*rows, peak]
    finally:
        stop(proc)


def quantize(args: argparse.Namespace, source: Path) -> list[Path]:
    out = []
    for t in args.types:
        target = Path(args.out_dir) / f"{source.stem.split('.')[0]}.{t}.gguf"
        cmd = [
            args.llama_quantize,
            "--allow-requantize",
            str(source),
            str(target),
            t,
            str(args.threads),
        ]
        emit({"quantize": " ".join(cmd)})
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append(target)
    return out


def _pair(o: float, ll: float, fmt: str) -> str:
    return f"{o:{fmt}} vs {ll:{fmt}} ({o / ll:.2f}x)" if o and ll else "-"


def summarize(rows: list[dict[str, Any]]) -> None:
    """Markdown tables: per file and C, ours vs llama-server and the ratios; prompt rate, RSS."""
    by = {(r["file"], r["server"], r["concurrency"]): r for r in rows}
    files = list(dict.fromkeys(r["file"] for r in rows))
    print("\n| file | C | out tok/s: ours vs llama (ratio) | TTFT p50 ms: ours vs llama | load |")
    print("|---|---|---|---|---|")
    for f in files:
        for c in sorted({r["concurrency"] for r in rows if r["file"] == f} - {0}):
            o, ll = by.get((f, "sluice", c), {}), by.get((f, "llama-server", c), {})
            rate = _pair(o.get("out_tok_s", 0), ll.get("out_tok_s", 0), ".1f")
            ttft = _pair(o.get("ttft_p50_ms", 0), ll.get("ttft_p50_ms", 0), ".0f")
            load = f"{o.get('loadavg_1m', ['-'])[0]} / {ll.get('loadavg_1m', ['-'])[0]}"
            print(f"| {f} | {c} | {rate} | {ttft} | {load} |")
    print("\n| file | prompt tok/s at C=1: ours vs llama | peak RSS GB: worker vs llama-server |")
    print("|---|---|---|")
    for f in files:
        o, ll = by.get((f, "sluice", 1), {}), by.get((f, "llama-server", 1), {})
        rate = _pair(o.get("server_prompt_tok_s", 0), ll.get("server_prompt_tok_s", 0), ".0f")
        peak = {
            r["server"]: r["peak_rss_bytes"] / 1e9
            for r in rows
            if r["file"] == f and "peak_rss_bytes" in r
        }
        print(
            f"| {f} | {rate} | {_pair(peak.get('sluice', 0), peak.get('llama-server', 0), '.2f')} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="GGUFs (default: the default model)")
    p.add_argument("--llama-server", default="llama-server")
    p.add_argument("--llama-quantize", help="write --types from the default model first")
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0", "Q4_K_M"])
    p.add_argument("--out-dir", default="/tmp")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--rounds", type=int, default=0, help="requests per client (0: 4 at C=1, else 2)"
    )
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--only", choices=["sluice", "llama-server"], help="run one server")
    args = p.parse_args()
    from services.worker.loaders import default_model_path

    files = list(args.files) or [default_model_path()]
    if args.llama_quantize:
        files += quantize(args, default_model_path())
    emit(
        {
            "machine": {
                "cpus": os.cpu_count(),
                "loadavg": os.getloadavg(),
                "args": {k: str(v) for k, v in vars(args).items()},
            }
        }
    )
    rows: list[dict[str, Any]] = []
    for f in files:
        args.current = f
        if args.only != "sluice":
            rows += run_llama(args, f)
        if args.only != "llama-server":
            rows += run_sluice(args, f)
    summarize(rows)


if __name__ == "__main__":
    main()
