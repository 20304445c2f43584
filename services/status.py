"""``sluice status``: what the cluster is doing, read straight from Redis.

Workers (model, device, slots busy/total, tokens/s, heartbeat age, version), each model's queue
(jobs no worker has picked up, the oldest one's wait, requests in flight) and the recent
failovers, as a table for people or JSON for scripts (``--json``), once or every few seconds
(``--watch``). It needs nothing but Redis: no API, no worker, no Prometheus.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services import redis_conn
from services.queue.client import Queue
from shared import keys
from shared.config import Settings

__all__ = ["format_text", "run_status", "snapshot"]

RECENT_FAILOVERS = 10


def _text(value: bytes | None, default: str = "") -> str:
    return value.decode() if value is not None else default


def _num(value: bytes | None) -> float:
    try:
        return float(value) if value is not None else 0.0
    except ValueError:
        return 0.0


async def snapshot(redis: aioredis.Redis, queue: Queue | None = None) -> dict[str, Any]:
    """One consistent-enough reading of the cluster (a few pipelined round trips); ``queue``: the
    model queues, when they are not on ``redis``."""
    now = time.time()
    beats = await redis.zrange(keys.workers(), 0, -1, withscores=True)
    names = sorted(m.decode() for m in await redis.smembers(keys.models()))  # type: ignore[misc]
    async with redis.pipeline(transaction=False) as pipe:
        for wid, _ in beats:
            pipe.hgetall(keys.worker(wid.decode()))
        for name in names:
            pipe.zcard(keys.inflight(name))
        pipe.lrange(keys.failovers(), 0, RECENT_FAILOVERS - 1)
        replies = await pipe.execute()
    workers = []
    for (wid, beat_ms), info in zip(beats, replies, strict=False):
        if not info:  # the hash expired: the worker stopped beating
            continue
        h = {k.decode(): v for k, v in info.items()}
        workers.append(
            {
                "id": wid.decode(),
                "model": _text(h.get("model")),
                "device": _text(h.get("device"), "?"),
                "slots_busy": int(_num(h.get("active"))),
                "slots_total": int(_num(h.get("slots"))),
                "tokens_per_s": _num(h.get("tokens_per_s")),
                "heartbeat_age_s": round(max(now - beat_ms / 1000, 0.0), 3),
                "version": _text(h.get("version"), "?"),
                "uptime_s": round(max(now - _num(h.get("started")), 0.0), 1),
                "served": int(_num(h.get("served"))),
            }
        )
    models = []
    for i, name in enumerate(names):
        queued = await (queue or Queue(redis)).waiting(name)
        models.append(
            {
                "name": name,
                "queued": len(queued),
                "oldest_wait_s": round(max(now - queued[0][1] / 1000, 0.0), 3) if queued else 0.0,
                "in_flight": int(replies[len(beats) + i]),
                "workers": sum(1 for w in workers if w["model"] == name),
            }
        )
    failovers = [json.loads(raw) for raw in replies[-1]]
    return {
        "at": now,
        "workers": workers,
        "models": models,
        "in_flight": sum(m["in_flight"] for m in models),
        "recent_failovers": failovers,
    }


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def format_text(snap: dict[str, Any]) -> str:
    """The human-readable view of a ``snapshot``."""
    out = [f"sluice status  {time.strftime('%H:%M:%S', time.localtime(snap['at']))}", ""]
    rows = [["WORKER", "MODEL", "DEVICE", "SLOTS", "TOK/S", "BEAT", "UP", "VERSION"]]
    for w in snap["workers"]:
        rows.append(
            [
                w["id"],
                w["model"],
                w["device"],
                f"{w['slots_busy']}/{w['slots_total']}",
                f"{w['tokens_per_s']:.1f}",
                f"{w['heartbeat_age_s']:.1f}s",
                f"{w['uptime_s'] / 60:.0f}m",
                w["version"],
            ]
        )
    out += _table(rows) if snap["workers"] else ["no live workers"]
    out.append("")
    rows = [["MODEL", "WORKERS", "QUEUED", "OLDEST WAIT", "IN FLIGHT"]]
    for m in snap["models"]:
        wait = f"{m['oldest_wait_s']:.1f}s"
        rows.append([m["name"], str(m["workers"]), str(m["queued"]), wait, str(m["in_flight"])])
    out += _table(rows) if snap["models"] else ["no models published"]
    out += ["", f"requests in flight: {snap['in_flight']}"]
    if snap["recent_failovers"]:
        out.append("recent failovers:")
        for f in snap["recent_failovers"]:
            when = time.strftime("%H:%M:%S", time.localtime(f["at"]))
            detail = f"{f['request_id']} ({f['model']}) attempt {f['attempt']} by {f['by']}"
            out.append(f"  {when}  {f['kind']:<9} {detail}")
    return "\n".join(out)


async def _run(settings: Settings, watch: float | None, as_json: bool) -> int:
    redis = redis_conn.client(settings.events_redis_url, socket_connect_timeout=5)
    queue = redis_conn.queue_client(settings.queue_redis_url, socket_connect_timeout=5)
    try:
        while True:
            snap = await snapshot(redis, Queue(queue))
            if as_json:
                print(json.dumps(snap), flush=True)
            else:
                clear = "\x1b[H\x1b[2J" if watch and sys.stdout.isatty() else ""
                print(clear + format_text(snap), flush=True)
            if not watch:
                return 0
            await asyncio.sleep(watch)
    finally:
        await redis.aclose()
        await queue.aclose()


def run_status(settings: Settings, *, watch: float | None = None, as_json: bool = False) -> int:
    """``sluice status [--watch [S]] [--json]``; exit 1 with one line when Redis cannot answer."""
    try:
        return asyncio.run(_run(settings, watch, as_json))
    except KeyboardInterrupt:
        return 0
    except (RedisError, OSError) as exc:
        url = settings.events_redis_url
        print(f"sluice status: cannot read Redis at {url}: {exc}", file=sys.stderr)
        return 1
