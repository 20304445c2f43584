"""``ops.bench.gpu_stack``'s smoke run on the CPU: the harness a GPU host runs once, end to end.

It writes the tiny random model, measures the engine in its own process, starts a private
redis-server (7 or later, from PATH as CI installs it, or the one carried in ``.whl/``), one
``sluice api`` and one ``sluice worker``, and streams from client processes. Nothing here is
timed: the rows must be well formed, every stream must get exactly ``--tokens`` completion
tokens of a ``--prompt``-token prompt, and every process must have been stopped and logged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_the_cpu_smoke_run_measures_engine_and_stack_on_every_stream(tmp_path: Path) -> None:
    out, logs = tmp_path / "rows.jsonl", tmp_path / "logs"
    args = ["--device", "cpu", "--shape", "tiny", "--streams", "4", "--prompt", "40"]
    args += ["--tokens", "8", "--out", str(out), "--logs", str(logs)]
    done = subprocess.run(
        [sys.executable, "-m", "ops.bench.gpu_stack", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert done.stdout.splitlines() == out.read_text().splitlines()
    assert [r["row"] for r in rows] == ["config", "engine", "warmup", "stack"]
    config, engine, warmup, stack = rows
    assert config["streams"] == 4 and int(config["redis"][1].split(".")[0]) >= 7
    assert engine["batch"] == 4 and engine["decode_steps"] > 0 and engine["decode_tok_s"] > 0
    assert warmup["all_tokens_ok"] is True
    assert stack["completion_tokens"] == [8, 8, 8, 8] and stack["all_tokens_ok"] is True
    assert stack["prompt_tokens"] == [40]
    assert len(stack["first_token_ms"]) == 4 and all(t > 0 for t in stack["first_token_ms"])
    assert stack["engine_tok_s"] == engine["decode_tok_s"]
    for rate, ratio in [("stack_tok_s", "ratio"), ("streams_tok_s", "streams_ratio")]:
        # None where a window is empty: all of a stream's tokens in one chunk, on a slow machine
        assert (stack[rate] is None) == (stack[ratio] is None)
        assert stack[rate] is None or stack[rate] > 0
    assert stack["wall_tok_s"] > 0 and stack["wall_ratio"] > 0
    assert set(stack["cpu_cores"]) == {"worker", "api", "redis", "clients0", "clients1"}
    assert {p.name for p in logs.iterdir()} == {"engine.log", "worker.log", "api.log", "redis.log"}
    assert "generation ended" in (logs / "worker.log").read_text()
    assert "POST /v1/chat/completions 200" in (logs / "api.log").read_text()
