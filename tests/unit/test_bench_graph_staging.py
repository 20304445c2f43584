"""``ops/bench/graph_staging.py`` runs and reports both ways (nothing here is timed)."""

from __future__ import annotations

import json

import pytest

from ops.bench import graph_staging


def test_the_bench_reports_both_ways_and_their_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--batch", "16", "--blocks", "8", "--steps", "16", "--repeats", "1"]
    monkeypatch.setattr("sys.argv", ["graph_staging", *args])
    graph_staging.main()
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (row["batch"], row["blocks"]) == (16, 8)
    assert {"rewrite_all_us", "stage_us", "ratio"} <= row.keys()
