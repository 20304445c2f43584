"""A worker's Prometheus metrics, served on its own port (``SLUICE_METRICS_PORT``).

Each worker process keeps its own registry and Prometheus scrapes every worker as a target:
counters and histograms then add up across workers with ``sum(rate(...))``, exactly as vLLM's
per-engine metrics do, and no sample ever travels through Redis. The names and meanings follow
vLLM's (``vllm:time_to_first_token_seconds`` is ``sluice_time_to_first_token_seconds``, and so
on); the request-level latencies are measured here, where every request passes exactly once,
rather than in the API, which also serves replays and resumed streams of the same request.

Times measured from the request's creation use the API's wall clock (``Job.created``), so on a
deployment spread over several hosts they include any clock skew between them.

The hot path costs a few histogram observations per decode step and nothing per token beyond
them: ``RequestTimer.batch`` is called once per published batch with numbers the job function
already has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, get_args
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from services.queue.affinity import OUTCOMES as AFFINITY_OUTCOMES
from services.redis_rtt import redis_rtt_histogram
from shared.events import AnyEvent, Error, ErrorKind, Finish, FinishReason, Start

__all__ = ["RequestTimer", "WorkerMetrics"]

log = logging.getLogger(__name__)

# Seconds: from a few ms (a warm GPU's first token) to minutes (a long answer on a busy CPU).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Seconds between tokens: a GPU step is a few ms, a loaded CPU step up to ~a second.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
STEP_BUCKETS = ITL_BUCKETS
# Sequences per decode step: powers of two up to the largest batch anyone configures.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# sluice_failovers' kinds: a sweeper claimed a lost request, a worker resumed one, a stopping
# worker left one to a peer, a request ended after its last allowed attempt
FAILOVER_KINDS = ("takeover", "continuation", "handover", "gave_up")


class WorkerMetrics:
    """The worker's metric families, bound to its own registry (one per ``WorkerContext``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Create the families; ``registry`` defaults to a fresh one (never the global)."""
        r = self.registry = registry or CollectorRegistry()
        m = ["model"]
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "Request creation (API) to the first generated token published",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sluice_inter_token_latency_seconds",
            "Time per generated token between consecutive published batches of one request",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sluice_e2e_request_latency_seconds",
            "Request creation (API) to its terminal event",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "sluice_request_queue_time_seconds",
            "Request creation (API) to a worker picking up the job from the model's queue",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "sluice_request_prefill_time_seconds",
            "A worker picking up the job to its first token (prefill, and any wait in the engine)",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens of started requests", m, registry=r
        )
        self.generation_tokens = Counter(
            "sluice_generation_tokens", "Generated tokens published", m, registry=r
        )
        self.success = Counter(
            "sluice_request_success",
            "Requests that ended with a Finish, by finish reason",
            [*m, "finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "sluice_request_errors",
            "Requests that ended with an Error, by error kind",
            [*m, "kind"],
            registry=r,
        )
        self.prefix_queries = Counter(
            "sluice_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m,
            registry=r,
        )
        self.prefix_hits = Counter(
            "sluice_prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            m,
            registry=r,
        )
        self.failovers = Counter(
            "sluice_failovers",
            "Failover steps: takeover (a sweeper claimed a lost request), continuation (this "
            "worker resumed one), handover (a stopping worker left one to a peer), gave_up",
            [*m, "kind"],
            registry=r,
        )
        self.running = Gauge(
            "sluice_num_requests_running", "Requests this worker is generating", m, registry=r
        )
        self.engine_waiting = Gauge(
            "sluice_num_requests_waiting_engine",
            "Requests picked up but waiting inside the engine for KV blocks (queued or preempted)",
            m,
            registry=r,
        )
        self.kv_usage = Gauge(
            "sluice_kv_cache_usage_perc",
            "Fraction of the paged KV cache's blocks held by running requests (0..1)",
            m,
            registry=r,
        )
        self.preemptions = Counter(
            "sluice_num_preemptions",
            "Running requests whose KV blocks were taken back when the pool ran dry (each "
            "resumes, recomputed from its tokens, when blocks free up)",
            m,
            registry=r,
        )
        self.step_time = Histogram(
            "sluice_decode_step_seconds",
            "Duration of one batched decode step",
            m,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "sluice_decode_batch_size",
            "Sequences in one batched decode step",
            m,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        # vLLM's spec_decode_* meanings: the acceptance rate is accepted / draft tokens, the
        # mean acceptance length 1 + accepted / drafts (tokens per verifying step)
        self.spec_drafts = Counter(
            "sluice_spec_decode_num_drafts", "Drafts verified (a speculating sequence's step)", m,
            registry=r,
        )  # fmt: skip
        self.spec_draft_tokens = Counter(
            "sluice_spec_decode_num_draft_tokens", "Draft tokens verified", m, registry=r
        )
        self.spec_accepted_tokens = Counter(
            "sluice_spec_decode_num_accepted_tokens", "Draft tokens the model chose too", m,
            registry=r,
        )  # fmt: skip
        self.affinity = Counter(
            "sluice_queue_affinity_pickups",
            "Jobs this worker started, by cache-aware pickup's outcome: hit (it was preferred, "
            "holding part of the prompt), miss (no worker held any), after_wait (another worker "
            "was preferred and did not take it within SLUICE_AFFINITY_WAIT_MS), busy (taken at "
            "once: the preferred worker had no free slot or was gone)",
            [*m, "outcome"],
            registry=r,
        )
        self.redis_rtt = redis_rtt_histogram(r)
        self.info = Gauge(
            "sluice_worker_info",
            "Always 1; labels name the worker",
            ["worker", "model", "device", "version"],
            registry=r,
        )
        self._server: WSGIServer | None = None

    def bind(
        self,
        *,
        model: str,
        wid: str,
        device: str,
        version: str,
        running: Callable[[], float],
        engine: Any,
    ) -> None:
        """Attach the gauges read at scrape time to the worker and its engine.

        ``engine`` is the backend's scheduler when it has one (``waiting``, ``kv_usage``,
        ``planner.on_preempt``, ``on_step``); a backend without one reports no engine queue,
        no KV usage and no decode steps.
        """
        self.info.labels(wid, model, device, version).set(1)
        self._zeros(model)
        self.running.labels(model).set_function(running)
        if engine is None:
            self.engine_waiting.labels(model).set(0)
            self.kv_usage.labels(model).set(0)
            return
        self.engine_waiting.labels(model).set_function(lambda: float(engine.waiting))
        self.kv_usage.labels(model).set_function(lambda: float(engine.kv_usage))
        preempted = self.preemptions.labels(model)
        engine.planner.on_preempt = lambda _seq: preempted.inc()
        step, size = self.step_time.labels(model), self.batch_size.labels(model)
        spec = getattr(engine, "speculator", None)  # None: speculation is off
        counted = [0, 0, 0]  # the speculator's counters already added
        spec_counters = [
            c.labels(model)
            for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens)
        ]

        def on_step(seconds: float, sequences: int) -> None:
            step.observe(seconds)
            size.observe(sequences)
            if spec is not None:
                now = (spec.stats.drafts, spec.stats.draft_tokens, spec.stats.accepted_tokens)
                for i, (counter, value) in enumerate(zip(spec_counters, now, strict=True)):
                    if value > counted[i]:
                        counter.inc(value - counted[i])
                        counted[i] = value

        engine.on_step = on_step

    def _zeros(self, model: str) -> None:
        """Create every series of ``model`` at zero, as vLLM does at start-up: a dashboard then
        shows 0 rather than "no data" before the first request (or the first error of a kind),
        and a ``rate()`` over a counter's first increment is not lost."""
        for family in (
            self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time,
            self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits,
            self.preemptions, self.step_time, self.batch_size, self.spec_drafts,
            self.spec_draft_tokens, self.spec_accepted_tokens,
        ):  # fmt: skip
            family.labels(model)
        for reason in get_args(FinishReason):
            self.success.labels(model, reason)
        for kind in get_args(ErrorKind):
            self.errors.labels(model, kind)
        for kind in FAILOVER_KINDS:
            self.failovers.labels(model, kind)
        for outcome in AFFINITY_OUTCOMES:
            self.affinity.labels(model, outcome)

    def pickups(self, model: str) -> Callable[[str], None]:
        """The queue consumer's ``on_pickup``: counts each outcome (every one from zero)."""
        counters = {o: self.affinity.labels(model, o) for o in AFFINITY_OUTCOMES}
        return lambda outcome: counters[outcome].inc()

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP from a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        bound: int = server.server_port
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        """Stop the HTTP endpoint, if one was started."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def request(self, model: str, created: float, attempt: int) -> RequestTimer:
        """A timer for one job this worker has just picked up."""
        return RequestTimer(self, model, created, attempt)


class RequestTimer:
    """Observes one request's latencies and counts as its batches are published."""

    __slots__ = ("_created", "_first", "_gen", "_last", "_m", "_model", "_picked", "attempt")

    def __init__(self, m: WorkerMetrics, model: str, created: float, attempt: int) -> None:
        """Start timing at pickup; the queue time is observed now (first attempts only)."""
        self._m, self._model, self._created, self.attempt = m, model, created, attempt
        self._first = attempt > 1  # a continuation's first token is not the request's
        self._last = 0.0
        self._picked = time.perf_counter()
        self._gen = m.generation_tokens.labels(model)
        if attempt > 1:
            m.failovers.labels(model, "continuation").inc()
        elif created > 0:
            m.queue_time.labels(model).observe(max(time.time() - created, 0.0))

    def batch(self, events: list[AnyEvent], new_tokens: int) -> None:
        """One batch was published; ``new_tokens`` generated tokens rode on it."""
        now = time.perf_counter()
        if new_tokens:
            self._gen.inc(new_tokens)
            if not self._first:
                self._first = True
                self._m.prefill_time.labels(self._model).observe(now - self._picked)
                if self._created > 0:
                    self._m.ttft.labels(self._model).observe(max(time.time() - self._created, 0))
            elif self._last:
                # a batch may carry several steps' tokens (SLUICE_STREAM_INTERVAL_S): each of
                # them took an equal share of the gap
                itl, per_token = self._m.itl.labels(self._model), (now - self._last) / new_tokens
                for _ in range(new_tokens):
                    itl.observe(per_token)
            self._last = now
        head = events[0] if events else None
        if isinstance(head, Start) and self.attempt == 1:
            self._m.prompt_tokens.labels(self._model).inc(head.prompt_tokens)
            self._m.prefix_queries.labels(self._model).inc(head.prompt_tokens)
            self._m.prefix_hits.labels(self._model).inc(head.cached_tokens)

    def done(self, terminal: AnyEvent | None) -> None:
        """The request left this worker; count how it ended (if it ended here)."""
        if isinstance(terminal, Finish):
            self._m.success.labels(self._model, terminal.reason).inc()
        elif isinstance(terminal, Error):
            self._m.errors.labels(self._model, terminal.kind).inc()
        else:
            return
        if self._created > 0:
            self._m.e2e.labels(self._model).observe(max(time.time() - self._created, 0.0))
