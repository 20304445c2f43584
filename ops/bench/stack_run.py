"""The whole stack under one streaming client: a private redis-server, ``sluice api`` and
``sluice worker`` as ``sluice up`` runs them, measured like the engine in ``vs_llamacpp.py``
(which calls ``run_stack``), so the two compare in one run."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ops.bench.machine_load import attempts, emit, load_probe
from ops.bench.streams import free_port


def _wait(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # not up yet: connection refused, 503, ...
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not come up in {seconds:.0f} s")


def run_stack(args: argparse.Namespace, threads: int, prompt: str) -> list[dict[str, Any]]:
    """Private redis-server + ``sluice api`` + ``sluice worker`` serving ``args.model``; one
    streaming chat client asking ``prompt``."""
    import httpx

    rport, aport = free_port(), free_port()
    env = {
        **os.environ,
        "SLUICE_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
        "SLUICE_PORT": str(aport),
        "SLUICE_HOST": "127.0.0.1",
        "SLUICE_THREADS": str(threads),
        "SLUICE_DTYPE": args.stack_dtype,
        "SLUICE_MODEL": args.model,
        "SLUICE_MODEL_NAME": "smollm2",  # the id the client asks for, whatever the file
    }
    sluice = str(Path(sys.executable).with_name("sluice"))
    procs = [
        subprocess.Popen(
            ["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        ),
    ]
    rows: list[dict[str, Any]] = []
    base = f"http://127.0.0.1:{aport}"
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    try:
        time.sleep(0.5)
        procs.append(subprocess.Popen([sluice, "worker"], env=env, **quiet))
        procs.append(subprocess.Popen([sluice, "api"], env=env, **quiet))
        with httpx.Client(timeout=60) as client:
            _wait(lambda: "smollm2" in client.get(f"{base}/v1/models").text, 120, "sluice worker")
            body = {
                "model": "smollm2",
                # The same text as the engine's prompt 0: the API renders the same ids.
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            done: list[dict[str, Any]] = []
            # -1: a warm-up; chain keeps attempts() lazy so it sees each appended row.
            for rep in itertools.chain([-1], attempts(args.repeats, args.max_others, done)):
                row: dict[str, Any] = {
                    "engine": "stack",
                    "dtype": args.stack_dtype,
                    "threads": threads,
                    "metric": "decode",
                    "batch": 1,
                    "repeat": rep,
                }
                times: list[float] = []
                usage: dict[str, Any] = {}
                url = f"{base}/v1/chat/completions"
                with (
                    load_probe([p.pid for p in procs], row),
                    client.stream("POST", url, json=body) as r,
                ):
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for c in chunk.get("choices", []):
                            if c.get("delta", {}).get("content"):
                                times.append(time.perf_counter())
                n = int(usage.get("completion_tokens", 0))
                row.update(
                    value=(n - 1) / (times[-1] - times[0]),
                    completion_tokens=n,
                    prompt_tokens=usage.get("prompt_tokens"),
                    content_chunks=len(times),
                )
                if rep >= 0:
                    emit(row)
                    done.append(row)
            rows.extend(done)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return rows
