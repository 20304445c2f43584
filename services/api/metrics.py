"""The API process's Prometheus metrics, served at ``GET /metrics``.

Every API process has its own registry (built by ``create_app``, no module globals) and is its
own scrape target, like every worker: Prometheus adds counters and histograms up across targets
(``sum(rate(...))``), so any number of API replicas and workers give one picture without a
sample ever passing through Redis or a lock shared between processes. ``sluice api`` runs one
uvicorn process; scale the API with more processes (containers), each scraped on its own.

What only the API sees is counted here: HTTP requests by route and status, admission rejections
by reason, stream resumes and replays by wire format, the stream hub's subscriptions and XREAD
batch sizes, and the Redis round trip of admission. The request-level latencies and token counts
are the workers' (``services/worker/metrics.py``), where each request passes exactly once.

The queue gauges (``sluice_num_requests_waiting`` and friends) describe Redis, not this process:
each scrape reads them from Redis (a few commands per model, never on a request's path), so
every API replica reports the same values: aggregate them with ``max by (model)``, not ``sum``.
So do ``sluice_redis_used_memory_bytes`` and ``sluice_redis_maxmemory_bytes`` (the event store's).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.queue.client import Queue
from services.redis_oom import read_memory
from services.redis_rtt import redis_rtt_histogram
from shared import keys

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["CONTENT_TYPE", "ApiMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Whole HTTP requests: a rejected request takes a millisecond, a streamed answer minutes.
HTTP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
# Entries one XREAD returned: 1 when idle, up to the hub's COUNT under load.
XREAD_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ApiMetrics:
    """The API's metric families on one registry."""

    def __init__(self) -> None:
        """Create the families on a fresh registry."""
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "sluice_http_requests",
            "HTTP requests answered, by route template, method, status and wire format",
            ["route", "method", "status", "format"],
            registry=r,
        )
        self.http_duration = Histogram(
            "sluice_http_request_duration_seconds",
            "Time from receiving a request to the end of its response body (streams included)",
            ["route", "format"],
            buckets=HTTP_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "sluice_admission_rejections",
            "Generation requests refused before enqueueing, by reason",
            ["reason", "status"],
            registry=r,
        )
        self.resumes = Counter(
            "sluice_stream_resumes",
            "Streams resumed after an entry (Last-Event-ID, ?after=, starting_after)",
            ["format"],
            registry=r,
        )
        self.replays = Counter(
            "sluice_replays",
            "Stored requests re-read through a GET route (streamed or whole), by wire format",
            ["format"],
            registry=r,
        )
        self.hub_subscriptions = Gauge(
            "sluice_hub_subscriptions",
            "Event-stream subscriptions open in this process's stream hub",
            registry=r,
        )
        self.xread_entries = Histogram(
            "sluice_hub_xread_entries",
            "Stream entries returned by one hub XREAD",
            buckets=XREAD_BUCKETS,
            registry=r,
        )
        self.redis_rtt = redis_rtt_histogram(r)
        self.waiting = Gauge(
            "sluice_num_requests_waiting",
            "Jobs in the model's queue that no worker has picked up (read from Redis at scrape)",
            ["model"],
            registry=r,
        )
        self.oldest_wait = Gauge(
            "sluice_queue_oldest_wait_seconds",
            "Age of the oldest job in the model's queue (read from Redis at scrape time)",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            "sluice_requests_in_flight",
            "Requests admitted and not yet ended, queued or running (read from Redis)",
            ["model"],
            registry=r,
        )
        self.workers = Gauge(
            "sluice_workers",
            "Workers with a live heartbeat, by model (read from Redis at scrape time)",
            ["model"],
            registry=r,
        )
        # Redis refuses writes (admission 503s, streams pause) once used reaches max: alert on
        # the ratio before it does (max 0: no limit set).
        self.redis_used = Gauge(
            "sluice_redis_used_memory_bytes", "Redis's used_memory, read at scrape time", registry=r
        )
        self.redis_max = Gauge(
            "sluice_redis_maxmemory_bytes", "Redis's maxmemory, 0 when unset", registry=r
        )

    async def render(self, redis: aioredis.Redis, queue: Queue | None = None) -> bytes:
        """Read the cluster gauges from Redis (``queue``: the model queues, when they are not
        on ``redis``), then the exposition text of the registry."""
        await self._read_cluster(redis, queue or Queue(redis))
        memory = await read_memory(redis)
        self.redis_used.set(memory.used_bytes)
        self.redis_max.set(memory.max_bytes)
        return generate_latest(self.registry)

    async def _read_cluster(self, redis: aioredis.Redis, queue: Queue) -> None:
        models = sorted(m.decode() for m in await redis.smembers(keys.models()))  # type: ignore[misc]
        worker_ids = [w.decode() for w in await redis.zrange(keys.workers(), 0, -1)]
        queues = [await queue.waiting(model) for model in models]
        async with redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.zcard(keys.inflight(model))
            for wid in worker_ids:
                pipe.hget(keys.worker(wid), "model")
            replies = await pipe.execute()
        live: dict[str, int] = {}
        for served in replies[len(models) :]:
            if served is not None:  # the hash expires three beats after the last one
                live[served.decode()] = live.get(served.decode(), 0) + 1
        now_ms = time.time() * 1000
        for gauge in (self.waiting, self.oldest_wait, self.in_flight, self.workers):
            gauge.clear()  # a model whose card is gone must not linger
        for model, queued, in_flight in zip(models, queues, replies, strict=False):
            self.waiting.labels(model).set(len(queued))
            age = (now_ms - queued[0][1]) / 1000 if queued else 0.0
            self.oldest_wait.labels(model).set(max(age, 0.0))
            self.in_flight.labels(model).set(in_flight)
            self.workers.labels(model).set(live.get(model, 0))
