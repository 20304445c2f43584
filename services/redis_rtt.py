"""``sluice_redis_rtt_seconds``, the one metric every API process and every worker exports.

Defined once so the two kinds of scrape target agree on its help text, labels and buckets:
Prometheus adds histograms across targets only bucket by bucket.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

__all__ = ["RTT_BUCKETS", "redis_rtt_histogram"]

# Redis round trips: sub-millisecond on one host, a few ms across a network.
RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


def redis_rtt_histogram(registry: CollectorRegistry) -> Histogram:
    """The round-trip histogram, labelled by operation, in ``registry``."""
    return Histogram(
        "sluice_redis_rtt_seconds",
        "Round-trip time of Redis calls, by operation",
        ["op"],
        buckets=RTT_BUCKETS,
        registry=registry,
    )
