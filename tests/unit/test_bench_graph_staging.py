"""``ops/bench/graph_staging.py`` runs and reports both ways (nothing here is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_reports_both_ways_and_their_ratio() -> None:
    args = ["--batch", "16", "--blocks", "8", "--steps", "16", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "ops.bench.graph_staging", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    row = json.loads(done.stdout.splitlines()[-1])
    assert (row["batch"], row["blocks"]) == (16, 8)
    assert {"rewrite_all_us", "stage_us", "ratio"} <= row.keys()
