"""The repository keeps its own promises: the README's settings table is ``Settings``, the
pre-commit hooks run what ``./ops/test`` runs, and no text points at documents outside the tree."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import msgspec
import pytest
import yaml

from shared.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def readme_settings() -> set[str]:
    """Every ``SLUICE_*`` variable named in the first column of the README's settings table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in table.splitlines():
        if line.startswith("| `SLUICE_"):
            names |= set(re.findall(r"`(SLUICE_[A-Z0-9_]+)`", line.split("|")[1]))
    return names


def test_readme_settings_table_is_exactly_the_settings_struct() -> None:
    fields = {f"SLUICE_{f.name.upper()}" for f in msgspec.structs.fields(Settings)}
    documented = readme_settings()
    assert fields - documented == set(), "settings missing from the README table"
    assert documented - fields == set(), "README table names settings that do not exist"


def test_no_sluice_variable_is_read_outside_settings() -> None:
    """``Settings.from_env`` is the one reader of ``SLUICE_*`` variables (tests and benches,
    which set them for child processes, aside)."""
    offenders = []
    for path in [
        p for pkg in ("shared", "services", "sluice_client") for p in ROOT.glob(f"{pkg}/**/*.py")
    ]:
        text = path.read_text(encoding="utf-8")
        if re.search(r"environ(\.get)?\(?\[?\s*[\"']SLUICE_", text) or 'getenv("SLUICE_' in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def ops_test_steps() -> list[str]:
    """The commands ``./ops/test`` runs through ``step``, tool names without the venv path."""
    steps = []
    for line in (ROOT / "ops/test").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("step "):
            words = shlex.split(line)[1:]
            steps.append(" ".join([Path(words[0]).name, *words[1:3]]))
    return steps


def test_pre_commit_runs_what_ops_test_runs() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    entries = [" ".join(Path(w).name if i == 0 else w for i, w in enumerate(h["entry"].split()))
               for h in hooks]  # fmt: skip
    steps = ops_test_steps()
    assert len(steps) >= 6  # ruff, ruff format, mypy, lint-imports, shellcheck, clang-format
    for step in steps:
        tool_and_verb = " ".join(step.split()[:2]) if step.startswith("ruff") else step.split()[0]
        assert any(entry.startswith(tool_and_verb) for entry in entries), step
    # and the whole suite, pytest included, before anything is pushed
    assert any(h["entry"] == "./ops/test" and h.get("stages") == ["pre-push"] for h in hooks)


def test_pre_commit_config_is_valid() -> None:
    exe = ROOT / ".venv/bin/pre-commit"
    if not exe.exists():
        pytest.skip("pre-commit is not installed in .venv")
    done = subprocess.run(
        [str(exe), "validate-config", ".pre-commit-config.yaml"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_text_cites_documents_outside_the_repository() -> None:
    """A reader of the repository has only the repository: every cited document must be in it.
    The hand-out notes the first sessions worked from are outside it, so naming them is a
    dangling reference (state the fact, link upstream, or move the material into docs/)."""
    outside = ["wire-formats", "redis-arq", "smollm2-gguf", "peers", "design", "style"]
    pattern = re.compile(r"\b(" + "|".join(outside) + r")\.md\b|\bhand" + r"book\b", re.I)
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".sh", ".c", ".h", ".toml", ".yml", ".yaml", ""}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # binary fixtures, or a file deleted in the tree
            continue
        offenders += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1)
                      if pattern.search(line)]  # fmt: skip
    assert offenders == []
