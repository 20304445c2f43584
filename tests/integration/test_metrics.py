"""Prometheus metrics under a scripted workload, through real uvicorn and a real worker.

The API's ``GET /metrics`` and the worker's own endpoint are scraped over HTTP before and after
a workload whose effects are known: counters grow by exactly the requests sent, histograms
observe each one, and the gauges go back to zero once everything has finished.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from shared.config import Settings
from tests.integration.server_harness import running_api
from tests.integration.worker_harness import WorkerHandle, running_worker
from tests.metrics_text import metric_names, sample

pytestmark = pytest.mark.integration

MONITORING = Path(__file__).resolve().parents[2] / "ops" / "monitoring"


def chat(model: str, *, stream: bool = False) -> dict[str, object]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


async def scrape(client: httpx.AsyncClient, url: str) -> str:
    reply = await client.get(url)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    return reply.text


def worker_metrics_url(worker: WorkerHandle) -> str:
    port = worker.running.wc.metrics.serve("127.0.0.1", 0)  # as SLUICE_METRICS_PORT does
    return f"http://127.0.0.1:{port}/metrics"


async def until_idle(client: httpx.AsyncClient, api: str, wurl: str, model: str) -> None:
    """Wait (bounded) until the gauges report an idle system; fails the test if they never do."""
    deadline = time.monotonic() + 30
    while True:
        a, w = await scrape(client, f"{api}/metrics"), await scrape(client, wurl)
        idle = (
            sample(w, "sluice_num_requests_running", model=model) == 0
            and sample(a, "sluice_num_requests_waiting", model=model) == 0
            and sample(a, "sluice_requests_in_flight", model=model) == 0
            and sample(a, "sluice_hub_subscriptions") == 0
        )
        if idle:
            return
        assert time.monotonic() < deadline, f"not idle:\n{a}\n{w}"
        await asyncio.sleep(0.1)


async def test_metrics_follow_a_scripted_workload(
    settings: Settings, redis: aioredis.Redis, redis_url: str
) -> None:
    async with (
        running_api(settings) as api,
        running_worker(redis_url, "scripted:text?rate=200") as worker,
        httpx.AsyncClient(timeout=30) as client,
    ):
        model = worker.name
        wurl = worker_metrics_url(worker)
        a0, w0 = await scrape(client, f"{api}/metrics"), await scrape(client, wurl)
        assert sample(a0, "sluice_workers", model=model) == 1
        assert sample(w0, "sluice_worker_info", worker=worker.wid, model=model) == 1

        whole = [client.post(f"{api}/v1/chat/completions", json=chat(model)) for _ in range(3)]
        replies = await asyncio.gather(*whole)
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        async with client.stream(
            "POST", f"{api}/v1/chat/completions", json=chat(model, stream=True)
        ) as streamed:
            rid = streamed.headers["x-request-id"]
            ids = [line[4:] async for line in streamed.aiter_lines() if line.startswith("id: ")]
        # A replay of a stored request, resumed after its first entry.
        replay = await client.get(
            f"{api}/v1/chat/completions/{rid}/events", headers={"Last-Event-ID": ids[0]}
        )
        assert replay.status_code == 200
        unknown = await client.post(f"{api}/v1/chat/completions", json=chat("no-such-model"))
        assert unknown.status_code == 404

        await until_idle(client, api, wurl, model)
        a1, w1 = await scrape(client, f"{api}/metrics"), await scrape(client, wurl)

    def grew(before: str, after: str, name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    # The worker: four requests, each observed once; tokens counted; every one finished.
    m = {"model": model}
    assert grew(w0, w1, "sluice_request_success_total", finished_reason="end_turn", **m) == 4
    for hist in (
        "sluice_time_to_first_token_seconds",
        "sluice_e2e_request_latency_seconds",
        "sluice_request_queue_time_seconds",
        "sluice_request_prefill_time_seconds",
    ):
        assert grew(w0, w1, f"{hist}_count", **m) == 4, hist
        assert grew(w0, w1, f"{hist}_sum", **m) > 0, hist
    generated = grew(w0, w1, "sluice_generation_tokens_total", **m)
    assert generated > 4 * 10  # the scripted reply is tens of tokens long
    assert grew(w0, w1, "sluice_inter_token_latency_seconds_count", **m) > 4
    assert grew(w0, w1, "sluice_prompt_tokens_total", **m) > 0
    assert grew(w0, w1, "sluice_prefix_cache_queries_total", **m) > 0
    assert grew(w0, w1, "sluice_redis_rtt_seconds_count", op="publish") > 4
    assert sample(w1, "sluice_num_requests_running", **m) == 0
    assert sample(w1, "sluice_request_errors_total", **m) == 0

    # The API: four admitted, one refused, one replay that resumed; the hub read entries.
    route = "/v1/chat/completions"
    assert grew(a0, a1, "sluice_http_requests_total", route=route, status="200") == 4
    assert grew(a0, a1, "sluice_http_requests_total", route=route, status="404") == 1
    assert grew(a0, a1, "sluice_admission_rejections_total", reason="model_not_found") == 1
    assert grew(a0, a1, "sluice_replays_total", format="openai_chat") == 1
    assert grew(a0, a1, "sluice_stream_resumes_total", format="openai_chat") == 1
    assert grew(a0, a1, "sluice_redis_rtt_seconds_count", op="admit") == 4
    assert grew(a0, a1, "sluice_hub_xread_entries_count") > 0
    assert grew(a0, a1, "sluice_hub_xread_entries_sum") >= generated / 10
    assert sample(a1, "sluice_hub_subscriptions") == 0
    assert sample(a1, "sluice_num_requests_waiting", model=model) == 0


def dashboard_metrics() -> set[str]:
    """Every sluice metric the Grafana dashboard and the Prometheus config name."""
    names: set[str] = set()
    dashboard = json.loads((MONITORING / "grafana/dashboards/sluice.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"\bsluice_[a-z0-9_]+\b", target["expr"]))
    names |= set(re.findall(r"\bsluice_[a-z0-9_]+\b", (MONITORING / "prometheus.yml").read_text()))
    return names


async def test_dashboard_uses_only_exported_metrics(
    settings: Settings, redis: aioredis.Redis, redis_url: str
) -> None:
    with socket.socket() as s:  # a free port for SLUICE_METRICS_PORT, as compose sets one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = {"metrics_port": port, "host": "127.0.0.1"}
    async with (
        running_api(settings) as api,
        running_worker(redis_url, "scripted:text?rate=0", overrides),
        httpx.AsyncClient(timeout=30) as client,
    ):
        exported = metric_names(await scrape(client, f"{api}/metrics"))
        exported |= metric_names(await scrape(client, f"http://127.0.0.1:{port}/metrics"))
    used = dashboard_metrics()
    assert len(used) > 20  # the panels really were read
    assert used - exported == set(), "the dashboard or scrape config names unexported metrics"
