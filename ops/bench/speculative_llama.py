"""llama-server's side of the speculative-decoding benchmark: the same workloads, measured the
same way, with no speculation and with its n-gram modes (``--spec-type ngram-simple`` and
``ngram-mod``), for ``speculative.py`` to report in the same run.

Each mode is a fresh ``llama-server -m GGUF -t THREADS -np C`` on the same GGUF the worker
loads. Each request is a streaming ``/v1/chat/completions`` call, one user message through the
model's own chat template, greedy, EOS honoured up to ``max_tokens``, the C prompts made
distinct by a number in front as sluice's are. The rate is sluice's: decode tokens over the
span from the last stream's first token to the last stream's end (prefill excluded), best of
``repeats``; drafted and accepted tokens come from llama-server's own ``timings``.

    .venv/bin/python -m ops.bench.speculative --llama-server PATH   # both, in one run
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from ops.bench.vs_server import free_port, stop, wait_until

__all__ = ["MODES", "llama_rows"]

# llama-server's speculation modes measured: none, and its two prompt-lookup kinds.
MODES = ("none", "ngram-simple", "ngram-mod")


@contextmanager
def _server(binary: str, gguf: Path, threads: int, slots: int, mode: str) -> Iterator[str]:
    port = free_port()
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(4096 * slots)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if mode != "none":
        cmd += ["--spec-type", mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(f"{base}/health", lambda r: r.status_code == 200, 300, proc)
        yield base
    finally:
        stop(proc)


async def _one(client: httpx.AsyncClient, base: str, text: str, tokens: int) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, text_out, last = 0.0, [], {}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if piece := (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    text_out.append(piece)
            if chunk.get("usage") or chunk.get("timings"):
                last = chunk
    timings = last.get("timings") or {}
    return {
        "first": first,
        "end": time.perf_counter(),
        "tokens": (last.get("usage") or {}).get("completion_tokens", 0),
        "text": "".join(text_out),
        "drafted": timings.get("draft_n", 0),
        "accepted": timings.get("draft_n_accepted", 0),
    }


async def _level(base: str, texts: list[str], tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        runs = await asyncio.gather(*(_one(client, base, t, tokens) for t in texts))
    span = max(r["end"] for r in runs) - max(r["first"] for r in runs)
    return {
        "rate": sum(r["tokens"] - 1 for r in runs) / span,
        "tokens": [r["tokens"] for r in runs],
        "drafted": sum(r["drafted"] for r in runs),
        "accepted": sum(r["accepted"] for r in runs),
        "texts": [r["text"] for r in runs],
    }


def llama_rows(
    binary: str,
    gguf: Path,
    workloads: dict[str, str],
    concurrency: list[int],
    *,
    threads: int,
    tokens: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """One row per mode, workload and concurrency: llama-server's best rate of ``repeats``.

    Args:
        binary: the llama-server executable.
        gguf: the model file the worker loads.
        workloads: name -> prompt text (``speculative.prompts()``).
        concurrency: the levels (C concurrent streams, ``-np C``).
        threads: llama-server's ``-t``.
        tokens: ``max_tokens`` per request.
        repeats: runs per level; the best counts.

    Returns:
        Rows with ``mode``, ``workload``, ``concurrency``, ``tok_s``, every run's rate, the
        tokens, drafted and accepted counts, and whether every mode wrote the same text.
    """
    rows: list[dict[str, Any]] = []
    first_texts: dict[tuple[str, int], list[str]] = {}
    for mode in MODES:
        for c in concurrency:
            with _server(binary, gguf, threads, c, mode) as base:
                asyncio.run(_level(base, ["Say hello."], 4))  # warm-up
                for name, text in workloads.items():
                    texts = [f"({i + 1}) {text}" for i in range(c)]
                    levels = [asyncio.run(_level(base, texts, tokens)) for _ in range(repeats)]
                    best = max(levels, key=lambda x: x["rate"])
                    same = first_texts.setdefault((name, c), best["texts"]) == best["texts"]
                    rows.append(
                        {
                            "server": "llama-server",
                            "mode": mode,
                            "workload": name,
                            "concurrency": c,
                            "tok_s": round(best["rate"], 1),
                            "runs": [round(x["rate"], 1) for x in levels],
                            "tokens": best["tokens"],
                            "drafted": best["drafted"],
                            "accepted": best["accepted"],
                            "same_text_as_none": same,
                        }
                    )
    return rows
