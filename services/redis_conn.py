"""The one place a Redis client is built from a URL: a single Redis, or a Redis Cluster.

``redis://`` / ``rediss://`` / ``unix://`` build redis-py's ``Redis``; ``redis+cluster://host:port``
(``rediss+cluster://`` with TLS) builds ``redis.asyncio.cluster.RedisCluster`` seeded with that
node, which discovers the rest of the cluster and follows MOVED/ASK redirections itself. Only the
events side may be a cluster: arq speaks to one Redis (``queue_client`` refuses a cluster URL).

``RedisCluster`` is not a subclass of ``Redis`` but offers the same command methods, so it is
returned typed as ``Redis``: code that must differ (transactions, the hub's blocking reads, the
scripts' doorbell) asks ``is_cluster``. What differs on a cluster, and why it is safe:

- every multi-key script or command touches one request's keys, which share the ``{rid}`` hash
  tag (``shared.keys``), so they live in one slot;
- a pipeline is split per node by redis-py (no MULTI: ``transactional`` says whether to ask);
- a blocking XREAD over many request streams is impossible (CROSSSLOT), so the API's hub uses
  ``services.api.cluster_hub`` instead.
"""

from __future__ import annotations

from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

__all__ = [
    "client",
    "is_cluster",
    "is_cluster_url",
    "queue_client",
    "queue_client_url",
    "transactional",
]

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return url.partition("://")[0] in _CLUSTER_SCHEMES


def client(url: str, *, worker: bool = False, **options: Any) -> aioredis.Redis:
    """A client for ``url``: ``Redis``, or ``RedisCluster`` for a cluster URL.

    Args:
        url: the Redis URL.
        worker: a worker's events client. On a cluster, redis-py re-sends a command whose
            connection broke (``cluster_error_retry_attempts``, default 3); a worker's publish
            script may have run before the break, and a re-sent one appends the batch again.
            A worker's client re-sends once at most (0 breaks redis-py 5's cluster pipelines),
            so a failover surfaces as an error and the request continues from what its log
            holds (the sweeper's continuation); docs/architecture.md has the residual window.
        options: further client options (timeouts, client name).
    """
    scheme, _, rest = url.partition("://")
    if scheme not in _CLUSTER_SCHEMES:
        plain: aioredis.Redis = aioredis.Redis.from_url(url, **options)
        return plain
    if worker:
        options.setdefault("cluster_error_retry_attempts", 1)
    cluster = RedisCluster.from_url(f"{_CLUSTER_SCHEMES[scheme]}://{rest}", **options)
    return cast(aioredis.Redis, cluster)


def queue_client_url(url: str) -> str:
    """``url`` checked for arq: a cluster URL is refused (arq needs a single Redis).

    Raises:
        ValueError: ``url`` is a cluster URL.
    """
    if is_cluster_url(url):
        raise ValueError(
            f"SLUICE_QUEUE_URL {url!r} is a Redis Cluster; arq's queue needs a single Redis "
            "(or one shard's node): set SLUICE_QUEUE_URL to a redis:// URL"
        )
    return url


def queue_client(url: str, **options: Any) -> aioredis.Redis:
    """A plain client for arq's keys (``queue_client_url`` checks ``url``)."""
    plain: aioredis.Redis = aioredis.Redis.from_url(queue_client_url(url), **options)
    return plain


def is_cluster(redis: object) -> bool:
    """Whether ``redis`` is a cluster client (or a cluster client's pipeline)."""
    return isinstance(redis, RedisCluster) or type(redis).__name__ == "ClusterPipeline"


def transactional(redis: object) -> bool:
    """Whether a pipeline on ``redis`` may be a MULTI/EXEC transaction (not on a cluster)."""
    return not is_cluster(redis)
