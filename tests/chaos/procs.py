"""Real processes for the chaos tests: a redis-server the test kills and restarts, and sluice's
own ``worker`` and ``api`` commands as child processes.

Each Redis listens on a unix socket in the test's temporary directory (no TCP port to collide
with the shared server or another session), with or without an append-only file. Killing is
SIGKILL, as a crash or an OOM kill would be; a restart reuses the directory, so with AOF on the
server comes back with what it had (``appendfsync always``: every acknowledged write is on disk,
so the figures are about sluice, not about Redis's one-second fsync window).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

__all__ = ["RedisServer", "Service", "free_port", "wait_http"]

ROOT = Path(__file__).resolve().parents[2]


class RedisServer:
    """A private redis-server the test owns: ``start``, ``kill`` (SIGKILL), ``start`` again."""

    def __init__(self, directory: Path, *, aof: bool) -> None:
        """Configure (does not start) a server on ``directory/redis.sock``."""
        self.directory = directory
        self.aof = aof
        self.socket = directory / "redis.sock"
        self.url = f"unix://{self.socket}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the server and wait until it answers PING (after loading its AOF)."""
        self.socket.unlink(missing_ok=True)
        cmd = [
            os.environ.get("REDIS_SERVER", "redis-server"),
            "--port", "0",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "yes" if self.aof else "no",
            "--appendfsync", "always",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                if self.socket.exists() and redis.Redis.from_url(self.url).ping():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.02)
        raise TimeoutError("redis-server did not answer")

    def kill(self) -> None:
        """SIGKILL the server and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def client(self) -> redis.Redis:
        """A synchronous client on the server."""
        return redis.Redis.from_url(self.url)


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """``python -m services.cli <args>`` as a child process with ``SLUICE_*`` settings."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        """Start the child; its output goes to ``log``."""
        self.log = log
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *args],
                env=full_env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def output(self) -> str:
        """Everything the process printed so far."""
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_http(url: str, *, status: int = 200, timeout_s: float = 30.0) -> httpx.Response:
    """Poll ``url`` until it answers ``status``; the last answer is returned."""
    deadline = time.monotonic() + timeout_s
    last: httpx.Response | None = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, timeout=2.0)
            if last.status_code == status:
                return last
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer {status} in {timeout_s} s (last: {last})")
