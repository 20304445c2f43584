"""`docker compose`, for real: ./ops/compose-test on a container engine, with the default model.

It runs where the engine DOCKER_HOST names answers or this machine can start a private one (root,
with ``dockerd`` or ``apt-get`` to install Debian's docker.io); elsewhere it skips with the reason,
and under ``CI=true`` that is a failure, so CI cannot go green by not checking. Its budget, measured
on a 2-core machine: 4.5 minutes from a cold cache (/var/cache/sluice-compose: debootstrap, the base
images, the torch index, every layer), 3.5 with the cache warm and the project's layers rebuilt (a
CI run after a commit), 2.7 with nothing to rebuild; 6.2 once with the machine's load at 6-7. The
25-minute timeout is for a slow machine, not the budget. The report (image sizes, the time from
``up`` to the first answer, how each README line ran) is kept in run/compose-report.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
CONTAINER_LINE = re.compile(r"\s*[\w.-]+_\d+\s+\|")  # docker-compose logs: "api_1  | ..."


def _no_engine_reason() -> str | None:
    """Why the script can have no engine here, or None (it uses DOCKER_HOST's or starts one)."""
    if os.environ.get("DOCKER_HOST") and shutil.which("docker"):
        probe = subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=30)
        if probe.returncode == 0:
            return None
    if os.geteuid() != 0:
        return "no engine answers at DOCKER_HOST, and starting a private one needs root"
    if not (shutil.which("dockerd") or shutil.which("apt-get")):
        return "no engine at DOCKER_HOST, and neither dockerd nor apt-get to install docker.io"
    return None


def test_compose_stack() -> None:
    reason = _no_engine_reason()
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the compose test must run in CI: {reason}")
        pytest.skip(reason)
    # Kept after the run (run/ is git-ignored): the numbers CI measured.
    report_file = ROOT / "run" / "compose-report.json"
    report_file.parent.mkdir(exist_ok=True)
    report_file.unlink(missing_ok=True)
    env = {**os.environ, "SLUICE_COMPOSE_REPORT": str(report_file)}
    with subprocess.Popen(
        [str(ROOT / "ops" / "compose-test")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            _, stderr = proc.communicate(timeout=1440)
        except subprocess.TimeoutExpired:
            # SIGTERM, so its trap removes the stack and stops its engine (a SIGKILL would leave
            # them to the next run, which stops an orphaned engine before it starts).
            proc.terminate()
            _, stderr = proc.communicate(timeout=180)
            pytest.fail(f"ops/compose-test ran past 24 minutes: {_why(stderr)}")
    assert proc.returncode == 0, _why(stderr)
    report = json.loads(report_file.read_text())
    numbers = report["report"]
    for key in ("build_s", "up_to_first_answer_s", "total_s"):
        assert float(numbers[key]) > 0, key
    assert "same text, finish and count" in numbers["failover"]
    assert numbers["prometheus"].startswith("scrapes the API and 2 workers")
    # Every README line was tried: as written, or with the request id for `req_…`; the GPU lines
    # resolved only, and the monitoring line for Prometheus alone where Grafana cannot be had.
    for line, how in report["readme"].items():
        if "docker-compose.gpu.yml" in line:
            assert how == "resolved only (needs a GPU)", line
        elif "req_…" in line:
            assert re.sub(r" \w+_\w+ ", " req_… ", how.removeprefix("as: "), count=1) == line
        elif "--profile monitoring" not in line or "grafana" not in numbers:
            assert how.startswith("as written"), (line, how)


def _why(stderr: str) -> str:
    """The script's own lines (a failed check's JSON, its log) before the containers' logs that
    its cleanup prints last, which alone would fill a truncated message."""
    own = [line for line in stderr.splitlines() if not CONTAINER_LINE.match(line)]
    return "\n".join(own[-60:]) + "\n--- the end of the output ---\n" + stderr[-6000:]
