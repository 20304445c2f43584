"""The Redis side of ``streams.py``: a private Redis or local cluster, and the servers behind an
events URL (CPU and command counters of every node, the publisher's per-primary routes)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from services import redis_conn
from shared import keys
from tests.cluster.nodes import LocalCluster

__all__ = ["CLUSTER_PORTS", "Nodes", "start_cluster", "start_redis"]

CLUSTER_PORTS = tuple(range(17100, 17106))  # the tests' fixture uses 17000-17005


class Nodes:
    """The Redis servers behind the events URL (one, or every cluster node), for CPU and
    command counts, and the publisher's routes (per primary, the requests it serves)."""

    def __init__(self, redis: aioredis.Redis, events_url: str) -> None:
        self.redis = redis
        self.cluster = redis_conn.is_cluster(redis)
        self.servers: list[aioredis.Redis] = [redis]
        self.url = events_url

    async def discover(self) -> None:
        if not self.cluster:
            return
        cluster = cast(RedisCluster, self.redis)
        await cluster.initialize()
        self.servers = [aioredis.Redis(host=n.host, port=int(n.port)) for n in cluster.get_nodes()]

    def primary(self, key: str) -> aioredis.Redis | None:
        """A plain client to the primary serving ``key`` (None on one Redis)."""
        if not self.cluster:
            return None
        node = cast(RedisCluster, self.redis).get_node_from_key(key)
        if node is None:
            raise LookupError(key)
        for server in self.servers:
            kwargs = server.connection_pool.connection_kwargs
            if (kwargs["host"], int(kwargs["port"])) == (node.host, int(node.port)):
                return server
        raise LookupError(key)

    def routes(self, rids: list[str]) -> list[tuple[str, int, list[str]]] | None:
        if not self.cluster:
            return None
        cluster = cast(RedisCluster, self.redis)
        by_node: dict[tuple[str, int], list[str]] = {}
        for rid in rids:
            node = cluster.get_node_from_key(keys.events(rid))
            if node is None:
                raise LookupError(rid)
            by_node.setdefault((node.host, int(node.port)), []).append(rid)
        return [(host, port, node_rids) for (host, port), node_rids in by_node.items()]

    async def counters(self) -> tuple[list[float], int]:
        """CPU seconds per server (user + system) and commands processed, all servers."""
        cpus, commands = [], 0
        for server in self.servers:
            info = await server.info()
            cpus.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
            commands += int(info["total_commands_processed"])
        return cpus, commands

    async def close(self) -> None:
        for server in self.servers:
            if server is not self.redis:
                await server.aclose()


def start_cluster(tmp: Path) -> LocalCluster:
    """A private 3-primary, 3-replica cluster on ``CLUSTER_PORTS`` (the tests use 17000-)."""
    cluster = LocalCluster(tmp / "cluster", CLUSTER_PORTS)
    cluster.start()
    # the API's hub reads from replicas: start it once every slot range lists one, as in a
    # deployment (a client that learns the map earlier reads the primaries)
    node = redis.Redis(port=CLUSTER_PORTS[0])
    for _ in range(300):
        slots = node.execute_command("CLUSTER SLOTS")  # type: ignore[no-untyped-call]
        if all(len(r) >= 4 for r in slots):
            break
        time.sleep(0.1)
    node.close()
    return cluster


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server on a unix socket (no persistence)."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        sys.exit("no redis-server on PATH (or pass a Redis URL where the benchmark takes one)")
    sock = tmp / "redis.sock"
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxclients",
            "20000",
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not sock.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.terminate()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.01)
    return proc, f"unix://{sock}"
