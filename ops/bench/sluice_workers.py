"""sluice with several workers for a benchmark: a private redis-server, ``sluice api`` and N
``sluice worker`` processes on one model, each worker with its own metrics port.

``sluice up`` runs one worker; cache-aware pickup (``services/queue/affinity.py``) needs more.
Each worker gets ``threads`` kernel threads (``SLUICE_THREADS``), so N workers of 1 thread on a
2-core machine get a core each, like one worker of 1 thread with half the load. At the end each
worker's affinity outcomes and prefix-cache counters are read from its ``/metrics``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from ops.bench.stream_nodes import start_redis
from ops.bench.vs_server import free_port, stop, wait_until

OUTCOMES = ("hit", "miss", "after_wait", "busy")


def _redis(tmp: Path, stack: ExitStack) -> str:
    """A private redis-server on a unix socket, stopped with the stack."""
    proc, url = start_redis(tmp)
    stack.callback(proc.wait)  # callbacks run last first: terminate, then wait
    stack.callback(proc.terminate)
    return url


def _spawn(args: list[str], env: dict[str, str], root: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)


@contextmanager
def sluice_workers(
    root: Path, gguf: Path, extra: dict[str, str], log: Path, workers: int, threads: int
) -> Iterator[tuple[str, str, list[int], int, list[str]]]:
    """(base URL, model id, every pid, the first worker's pid, each worker's metrics URL)."""
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **extra, "SLUICE_REDIS_URL": _redis(Path(tmp), stack)}
        env["SLUICE_HOST"] = "127.0.0.1"
        env["SLUICE_THREADS"] = str(threads)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
        cli = [sys.executable, "-m", "services.cli"]
        metrics: list[str] = []
        procs: list[subprocess.Popen[bytes]] = []
        for _ in range(workers):
            port = free_port()
            wenv = {**env, "SLUICE_METRICS_PORT": str(port)}
            procs.append(_spawn([*cli, "worker", "--model", str(gguf)], wenv, root, log))
            stack.callback(stop, procs[-1])
            metrics.append(f"http://127.0.0.1:{port}/metrics")
        api_port = free_port()
        api = _spawn([*cli, "api", "--port", str(api_port)], env, root, log)
        stack.callback(stop, api)
        base = f"http://127.0.0.1:{api_port}"
        for url, proc in zip(metrics, procs, strict=True):
            wait_until(url, lambda r: r.status_code == 200, 300, proc)
        listed = wait_until(
            f"{base}/v1/models", lambda r: r.status_code == 200 and r.json()["data"], 60, api
        )
        pids = [api.pid, *(p.pid for p in procs)]
        yield base, listed[0]["id"], pids, procs[0].pid, metrics


def _sample(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (0 when there are none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def worker_counts(metrics: list[str]) -> list[dict[str, Any]]:
    """Per worker: jobs started by affinity outcome, prompt tokens looked up and served from
    its prefix cache."""
    out = []
    for url in metrics:
        text = httpx.get(url, timeout=10).text
        row: dict[str, Any] = {
            o: _sample(text, "sluice_queue_affinity_pickups_total", outcome=o) for o in OUTCOMES
        }
        # picked up within 20 / 40 / 60 / 100 ms of the API's admission (histogram buckets):
        # what the affinity wait must exceed for a preferred worker that is alive and well
        row["queued_within"] = {
            ms: _sample(text, "sluice_request_queue_time_seconds_bucket", le=str(ms / 1000))
            for ms in (20, 40, 60, 100)
        }
        row["prefix_queried"] = _sample(text, "sluice_prefix_cache_queries_total")
        row["prefix_hit"] = _sample(text, "sluice_prefix_cache_hits_total")
        # jobs it started (first attempts: each observes its queue time once, affinity on or off)
        row["jobs"] = _sample(text, "sluice_request_queue_time_seconds_count")
        out.append(row)
    return out


def summarize_workers(rows: list[dict[str, Any]]) -> None:
    """A Markdown table of each worker's pickups by outcome and prefix-cache share, per level."""
    print("\n| S | workers | affinity wait ms | worker | jobs | hit | miss | after wait | busy "
          "| prompt tokens from its cache | picked up within 20 / 40 / 60 / 100 ms |\n|"
          + "---|" * 11)  # fmt: skip
    for r in rows:
        for i, w in enumerate(r.get("worker_counts", [])):
            share = w["prefix_hit"] / w["prefix_queried"] if w["prefix_queried"] else 0.0
            print(
                f"| {r['sessions']} | {len(r['worker_counts'])} | {r['affinity_wait_ms']} | {i} "
                f"| {w['jobs']:.0f} | {w['hit']:.0f} | {w['miss']:.0f} | {w['after_wait']:.0f} "
                f"| {w['busy']:.0f} | {100 * share:.1f}% "
                f"| {' / '.join(f'{v:.0f}' for v in w['queued_within'].values())} |"
            )
