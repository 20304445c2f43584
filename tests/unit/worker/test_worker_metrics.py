"""A worker's metric series exist from start-up, at zero, for the model it serves (as vLLM's).

Without them a dashboard shows "no data" until the first request (and an error panel until the
first error of each kind), and ``rate()`` over a counter born at 1 misses that first increment.
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.queue.affinity import OUTCOMES
from services.worker.metrics import FAILOVER_KINDS, WorkerMetrics
from shared.events import ErrorKind, FinishReason
from tests.metrics_text import sample


def started() -> str:
    """The exposition text of a worker bound to its model, before any request."""
    metrics = WorkerMetrics()
    metrics.bind(model="m", wid="w", device="cpu", version="t", running=lambda: 0.0, engine=None)
    return generate_latest(metrics.registry).decode()


def test_every_model_series_exists_at_zero_before_the_first_request() -> None:
    text = started()
    for family in text_string_to_metric_families(text):
        if family.name in ("sluice_redis_rtt", "sluice_redis_rtt_seconds"):
            continue  # labelled by operation, not by model: it starts with the first call
        ours = [s for s in family.samples if s.labels.get("model") == "m"]
        assert ours, f"{family.name} has no series for the model at start-up"
        if family.name != "sluice_worker_info":
            assert all(s.value == 0 for s in ours if not s.name.endswith("_created"))


def test_labelled_counters_have_every_value_from_the_start() -> None:
    text = started()
    for reason in get_args(FinishReason):
        assert ("finished_reason", reason) in _label_pairs(text, "sluice_request_success_total")
    for kind in get_args(ErrorKind):
        assert ("kind", kind) in _label_pairs(text, "sluice_request_errors_total")
    for kind in FAILOVER_KINDS:
        assert ("kind", kind) in _label_pairs(text, "sluice_failovers_total")
    for outcome in OUTCOMES:
        assert ("outcome", outcome) in _label_pairs(text, "sluice_queue_affinity_pickups_total")
    assert sample(text, "sluice_time_to_first_token_seconds_count", model="m") == 0


def _label_pairs(text: str, name: str) -> set[tuple[str, str]]:
    return {
        pair
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
        for pair in s.labels.items()
    }
