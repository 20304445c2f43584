"""The cluster fixtures: one local Redis Cluster per session, real API and worker processes.

The event log lives on the cluster (``SLUICE_EVENTS_URL=redis+cluster://…``) and arq's queue on
the single test Redis (``SLUICE_QUEUE_URL``), as a deployment would run them. Without
``redis-server`` the suite skips on a developer machine and fails under ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests.chaos.procs import Service, free_port, wait_http
from tests.cluster.nodes import LocalCluster
from tests.conftest import TEST_REDIS_URL

pytestmark = pytest.mark.integration

ENV = {
    "SLUICE_HEARTBEAT_S": "0.2",
    "SLUICE_LEASE_TTL_S": "1.5",
    "SLUICE_KEEPALIVE_S": "0.5",
    "SLUICE_THREADS": "1",
    "SLUICE_LOG_LEVEL": "warning",
}
MODEL = "scripted-long"


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """Three primaries and three replicas on ports 17000-17005, stopped after the session."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if _ci():
            pytest.fail("redis-server and redis-cli are required for the Redis Cluster tests")
        pytest.skip("redis-server/redis-cli not installed")
    directory = Path(tempfile.mkdtemp(prefix="sluice-cluster-"))
    cluster = LocalCluster(directory)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Stack:
    """The cluster, workers and API processes, all real."""

    cluster: LocalCluster
    directory: Path
    env: dict[str, str]
    apis: list[tuple[Service, str]] = field(default_factory=list)
    workers: list[Service] = field(default_factory=list)

    @property
    def base(self) -> str:
        """The first API's base URL."""
        return self.apis[0][1]

    def start_worker(self, spec: str = "scripted:long?rate=150") -> Service:
        """One more ``sluice worker``."""
        log = self.directory / f"worker{len(self.workers)}.log"
        worker = Service(["worker", "--model", spec], self.env, log)
        self.workers.append(worker)
        return worker

    def start_api(self) -> str:
        """One more ``sluice api`` on a free port; its base URL once /readyz answers."""
        port = free_port()
        log = self.directory / f"api{len(self.apis)}.log"
        api = Service(["api", "--port", str(port)], self.env, log)
        base = f"http://127.0.0.1:{port}"
        self.apis.append((api, base))
        wait_http(f"{base}/readyz", timeout_s=60)
        return base

    def logs(self) -> str:
        """Every child's output, for an assertion message."""
        parts = [s.output()[-3000:] for s in [*self.workers, *(a for a, _ in self.apis)]]
        return "\n----\n".join(parts)

    def close(self) -> None:
        """Kill every process."""
        for service in [*self.workers, *(a for a, _ in self.apis)]:
            service.kill()


@pytest.fixture
def cluster_stack(local_cluster: LocalCluster) -> Iterator[Callable[..., Stack]]:
    """``cluster_stack(workers=1, apis=1)``: a stack on a flushed cluster, torn down after."""
    local_cluster.revive()  # a node an earlier test killed rejoins as a replica
    local_cluster.flush()
    queue = redis.Redis.from_url(TEST_REDIS_URL)
    queue.flushdb()
    made: list[Stack] = []

    def make(*, workers: int = 1, apis: int = 1) -> Stack:
        directory = Path(tempfile.mkdtemp(prefix="sluice-cl-"))
        env = {**ENV, "SLUICE_EVENTS_URL": local_cluster.url, "SLUICE_QUEUE_URL": TEST_REDIS_URL}
        built = Stack(local_cluster, directory, env)
        made.append(built)
        for _ in range(workers):
            built.start_worker()
        for _ in range(apis):
            built.start_api()
        return built

    yield make
    for built in made:
        built.close()
        shutil.rmtree(built.directory, ignore_errors=True)
    queue.flushdb()
