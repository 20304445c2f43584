"""A local Redis Cluster for the tests: three primaries with one replica each, on loopback.

``LocalCluster.start()`` runs six ``redis-server --cluster-enabled yes`` processes on ports
17000-17005 (no persistence; a short ``cluster-node-timeout`` so a killed primary's replica is
promoted within seconds), joins them with ``redis-cli --cluster create --cluster-replicas 1`` and
waits for ``cluster_state:ok``. ``kill`` SIGKILLs one node, ``revive`` restarts the dead ones
(each rejoins from its nodes.conf, as a replica of whoever took its slots).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from redis.cluster import RedisCluster

__all__ = ["PORTS", "LocalCluster"]

PORTS = tuple(range(17000, 17006))
NODE_TIMEOUT_MS = 1000


class LocalCluster:
    """Six redis-server processes forming one cluster; the test owns them."""

    def __init__(self, directory: Path, ports: tuple[int, ...] = PORTS) -> None:
        """Configure (does not start) the nodes under ``directory``, on ``ports`` (a multiple
        of two: half primaries, half replicas; ``ops/bench/streams.py`` uses its own range)."""
        self.directory = directory
        self.ports = ports
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.url = f"redis+cluster://127.0.0.1:{ports[0]}"

    def _spawn(self, port: int) -> None:
        node_dir = self.directory / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            os.environ.get("REDIS_SERVER", "redis-server"),
            "--port", str(port), "--bind", "127.0.0.1",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--appendonly", "no", "--save", "", "--dir", str(node_dir),
            "--logfile", str(node_dir / "redis.log"),
        ]  # fmt: skip
        self.procs[port] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=port, socket_connect_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.02)
        raise TimeoutError(f"redis-server on {port} did not answer")

    def start(self) -> None:
        """Start the six nodes and form the cluster."""
        for port in self.ports:
            self._spawn(port)
        create = [shutil.which("redis-cli") or "redis-cli", "--cluster", "create"]
        create += [f"127.0.0.1:{p}" for p in self.ports]
        create += ["--cluster-replicas", "1", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and each primary has its replicas."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if all(self._settled(p) for p in self.live()):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the cluster did not settle")

    def _settled(self, port: int) -> bool:
        node = redis.Redis(port=port, socket_connect_timeout=1)
        if node.cluster("info")["cluster_state"] != "ok":
            return False
        nodes = node.cluster("nodes")  # {address: {"flags": …, …}}
        # every live node known and not marked failing (a revived one has rejoined)
        healthy = [n for n in nodes.values() if "fail" not in n["flags"]]
        return len(healthy) >= len(self.live())

    def live(self) -> list[int]:
        """Ports of the nodes running now."""
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def client(self) -> RedisCluster:
        """A synchronous cluster client."""
        return RedisCluster(host="127.0.0.1", port=self.live()[0])

    def primary_of(self, key: str) -> int:
        """The port of the primary serving ``key``'s slot (CLUSTER KEYSLOT + CLUSTER SLOTS)."""
        node = redis.Redis(port=self.live()[0])
        slot = int(node.execute_command("CLUSTER KEYSLOT", key))
        for start, end, primary, *_ in node.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(primary[1])
        raise LookupError(f"no node serves slot {slot}")

    def flush(self) -> None:
        """FLUSHALL on every primary (replicas follow)."""
        for port in self.live():
            node = redis.Redis(port=port)
            if node.execute_command("ROLE")[0] == b"master":
                node.flushall()

    def kill(self, port: int) -> None:
        """SIGKILL one node."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def revive(self) -> None:
        """Restart every dead node and wait until the cluster has settled with it."""
        dead = [p for p, proc in self.procs.items() if proc.poll() is not None]
        for port in dead:
            self._spawn(port)
        if dead:
            self.wait_ok()

    def stop(self) -> None:
        """Kill every node."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
