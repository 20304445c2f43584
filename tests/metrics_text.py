"""Reading Prometheus exposition text in tests (the official parser, no regexes)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["metric_names", "sample"]


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def metric_names(text: str) -> set[str]:
    """Every family name and sample name the text declares (``x``, ``x_total``, ``x_bucket``…)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        names |= {s.name for s in family.samples}
    return names
