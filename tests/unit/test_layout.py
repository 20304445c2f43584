"""Dependency direction and import hygiene, checked statically and at run time.

Static: the import-linter contracts in pyproject.toml (``lint-imports``). Run time: each import
check runs in a fresh interpreter, because whether ``torch`` got imported is a property of
``sys.modules`` that this test process (which may have imported anything) cannot answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Imports every module of a package in a fresh interpreter and reports what got loaded.
# An audit hook records I/O done while importing: sockets, subprocesses, and opening any file
# that is not part of the code being imported (Python source, bytecode, extension modules).
_PROBE = r"""
import importlib, json, pkgutil, sys

CODE_SUFFIXES = (".py", ".pyc", ".so", ".pth", ".pyi")
IO_EVENTS = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork")
io_seen = []

def hook(event, args):
    if event.startswith(IO_EVENTS):
        io_seen.append(event)
    elif event == "open" and args and isinstance(args[0], (str, bytes)):
        path = args[0] if isinstance(args[0], str) else args[0].decode(errors="replace")
        mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
        if any(c in mode for c in "wax+") or not path.endswith(CODE_SUFFIXES):
            io_seen.append(f"open {path} {mode}")

sys.addaudithook(hook)
imported = []
for root in sys.argv[1:]:
    pkg = importlib.import_module(root)
    imported.append(root)
    for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), prefix=root + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
print(json.dumps({"imported": imported, "modules": sorted(sys.modules), "io": io_seen}))
"""


def _probe(*packages: str) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *packages],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, f"importing {packages} failed:\n{out.stderr}"
    result: dict[str, list[str]] = json.loads(out.stdout.splitlines()[-1])
    return result


def _loaded(modules: list[str], *tops: str) -> list[str]:
    return [m for m in modules if m.split(".")[0] in tops]


def test_import_contracts_hold() -> None:
    exe = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run(
        [str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_only_the_queue_package_may_import_arq() -> None:
    """The arq contract names every module of ``services`` but the queue package: a new module
    left off its list could import arq unchecked."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (arq,) = [c for c in contracts["contracts"] if c["forbidden_modules"] == ["arq"]]
    tops = {p.stem for p in (ROOT / "services").iterdir() if p.suffix == ".py" or p.is_dir()}
    tops -= {"__init__", "__pycache__", "queue"}
    expected = {"shared", "sluice_client"} | {f"services.{t}" for t in tops}
    assert set(arq["source_modules"]) == expected


def test_shared_is_pure_contract() -> None:
    """``shared`` pulls in no service, no torch, no web framework, and does no I/O at import."""
    result = _probe("shared")
    assert "shared.events" in result["imported"]  # the walk really covered the package
    forbidden = _loaded(result["modules"], "services", "torch", "fastapi", "starlette", "arq")
    assert forbidden == []
    assert result["io"] == []


def test_api_never_imports_torch() -> None:
    """Every API module together, as ``sluice api`` would load them, stays free of torch."""
    result = _probe("services.api")
    assert "services.api.app" in result["imported"]
    forbidden = _loaded(result["modules"], "torch", "numpy", "gguf", "safetensors")
    assert forbidden == []
    both = {"services", "services.redis_conn", "services.redis_rtt", "services.redis_oom"}  # shared
    # the queue's client side only: the consumer (arq's worker) is the worker's; the enqueue
    # script's affinity part comes from affinity.py, which imports no worker code
    both |= {"services.queue", "services.queue.client", "services.queue.arq_keys"}
    both |= {"services.queue.affinity"}
    assert _loaded(result["modules"], "services") == [
        m for m in result["modules"] if m in both or m.startswith("services.api")
    ]


@pytest.mark.parametrize("package", ["services.cli", "services.launcher"])
def test_entry_points_load_services_lazily(package: str) -> None:
    """The CLI and the launcher import neither service, so ``sluice api`` stays torch-free."""
    result = _probe(package)
    assert _loaded(result["modules"], "torch", "fastapi") == []
    assert not any(m.startswith(("services.api", "services.worker")) for m in result["modules"])


def test_worker_never_imports_the_web_stack() -> None:
    result = _probe("services.worker")
    assert "services.worker.backend" in result["imported"]
    assert _loaded(result["modules"], "fastapi", "starlette", "uvicorn") == []
    assert not any(m.startswith("services.api") for m in result["modules"])
