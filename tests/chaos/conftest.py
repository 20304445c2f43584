"""The chaos fixture: a private Redis, a real worker process and a real API process.

``stack(aof=...)`` starts the three with short timers (0.2 s heartbeat, 1.5 s lease) so an
outage plays out in seconds; the test kills and restarts them through the returned ``Stack``.
Everything runs in a fresh temporary directory (short path: unix sockets allow ~100 bytes) and
is killed at the end of the test, whatever happened.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.chaos.procs import RedisServer, Service, free_port, wait_http

pytestmark = pytest.mark.integration

CHAOS_ENV = {
    "SLUICE_HEARTBEAT_S": "0.2",
    "SLUICE_LEASE_TTL_S": "1.5",
    "SLUICE_KEEPALIVE_S": "0.5",
    "SLUICE_THREADS": "1",
    "SLUICE_LOG_LEVEL": "warning",
}
LONG_MODEL = "scripted-long"


@dataclass
class Stack:
    """Redis, workers and one API, all real processes."""

    directory: Path
    redis: RedisServer
    env: dict[str, str]
    base: str = ""
    api: Service | None = None
    workers: list[Service] = field(default_factory=list)

    def start_worker(self, spec: str = "scripted:long?rate=150") -> Service:
        """One more ``sluice worker`` on the stack's Redis."""
        n = len(self.workers)
        worker = Service(["worker", "--model", spec], self.env, self.directory / f"worker{n}.log")
        self.workers.append(worker)
        return worker

    def start_api(self) -> None:
        """``sluice api`` on a free port; waits for /healthz."""
        port = free_port()
        self.api = Service(["api", "--port", str(port)], self.env, self.directory / "api.log")
        self.base = f"http://127.0.0.1:{port}"
        wait_http(f"{self.base}/healthz")

    def logs(self) -> str:
        """Every child's output, for an assertion message."""
        parts = [s.output()[-3000:] for s in [*self.workers, *([self.api] if self.api else [])]]
        return "\n----\n".join(parts)

    def close(self) -> None:
        """Kill everything."""
        for service in [*self.workers, *([self.api] if self.api else [])]:
            service.kill()
        self.redis.kill()


@pytest.fixture
def stack() -> Iterator[Callable[..., Stack]]:
    """``stack(aof=False, workers=1)``: a started stack, torn down after the test."""
    made: list[Stack] = []

    def make(*, aof: bool = False, workers: int = 1, **env: str) -> Stack:
        directory = Path(tempfile.mkdtemp(prefix="sluice-chaos-"))
        redis = RedisServer(directory, aof=aof)
        redis.start()
        settings = {**CHAOS_ENV, **env, "SLUICE_REDIS_URL": redis.url}
        built = Stack(directory, redis, settings)
        made.append(built)
        for _ in range(workers):
            built.start_worker()
        built.start_api()
        if workers:
            wait_http(f"{built.base}/readyz")
        return built

    yield make
    for built in made:
        built.close()
        shutil.rmtree(built.directory, ignore_errors=True)
