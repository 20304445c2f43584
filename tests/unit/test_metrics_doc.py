"""The README's metrics table lists exactly the metric families the API and workers export."""

from __future__ import annotations

import re
from pathlib import Path

from services.api.metrics import ApiMetrics
from services.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]


def exported() -> set[str]:
    names: set[str] = set()
    for registry in (ApiMetrics().registry, WorkerMetrics().registry):
        for family in registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def documented() -> set[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("### Metrics", 1)[1].split("\n### ", 1)[0]
    names: set[str] = set()
    for line in table.splitlines():
        if line.startswith("| `sluice_"):
            names |= set(re.findall(r"`(sluice_[a-z0-9_]+)`", line.split("|")[1]))
    return names


def test_readme_metrics_table_is_what_the_services_export() -> None:
    assert exported() - documented() == set(), "metrics missing from the README table"
    assert documented() - exported() == set(), "README table names metrics nobody exports"
