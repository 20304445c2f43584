"""The real agent programs, Codex CLI and Claude Code, pinned and installed from npm for tests.

Both are installed into a cache folder outside the repository (``~/.cache/sluice-clients``, or
``$XDG_CACHE_HOME/sluice-clients``), once per version. Without npm the tests skip on a
developer machine and fail under ``CI=true``, like the docker-compose checks, so CI can never go
green by not running them; an install that fails fails under CI too.

Neither program may reach the internet: every environment variable and config key below points
them at 127.0.0.1 only and turns off telemetry, update checks, error reporting and analytics.
Their home folders are fresh temporary directories, so nothing of the developer's own setup
(logins, settings, MCP servers) leaks in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = [
    "CLAUDE_CODE",
    "CODEX",
    "claude_env",
    "client_bin",
    "codex_config",
]

CODEX = "@openai/codex@0.169.0"
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"
_BINS = {CODEX: "codex", CLAUDE_CODE: "claude"}
_INSTALL_TIMEOUT_S = 600


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _unavailable(message: str) -> None:
    if _in_ci():
        pytest.fail(message)
    pytest.skip(message)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice-clients"


def client_bin(package: str) -> Path:
    """The pinned client's executable, installed on first use.

    Args:
        package: ``CODEX`` or ``CLAUDE_CODE`` (name@version).

    Returns:
        The path of its binary.
    """
    name, _, version = package.rpartition("@")
    folder = _cache_dir() / f"{name.replace('/', '+')}-{version}"
    binary = folder / "node_modules" / ".bin" / _BINS[package]
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        _unavailable(f"npm is not installed: cannot install {package}")
    assert npm is not None
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", package],
        capture_output=True,
        text=True,
        timeout=_INSTALL_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0 or not binary.exists():
        _unavailable(f"npm install {package} failed:\n{done.stderr[-2000:]}")
    return binary


def codex_config(home: Path, base_url: str, model: str, instructions: str) -> dict[str, str]:
    """Write a ``CODEX_HOME`` that talks to sluice only; return the environment to run with.

    Args:
        home: an empty folder to use as ``CODEX_HOME`` (and ``HOME``).
        base_url: sluice's ``.../v1``.
        model: the model id to ask for (a catalog id, so Codex sends its full request).
        instructions: the base instructions (a short brief keeps a small model's prompt small).

    Returns:
        The environment for ``codex exec``.
    """
    brief = home / "instructions.md"
    brief.write_text(instructions)
    (home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "sluice"\n'
        f'model_instructions_file = "{brief}"\n'
        "check_for_update_on_startup = false\n"
        'approval_policy = "never"\n'
        'sandbox_mode = "read-only"\n'
        "[analytics]\nenabled = false\n"
        "[feedback]\nenabled = false\n"
        "[model_providers.sluice]\n"
        'name = "sluice"\n'
        f'base_url = "{base_url}"\n'
        'wire_api = "responses"\n'
        'env_key = "CODEX_SLUICE_KEY"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "CODEX_HOME": str(home),
        "CODEX_SLUICE_KEY": "unused",
        "NO_PROXY": "127.0.0.1,localhost",
    }


def claude_env(home: Path, base_url: str, model: str) -> dict[str, str]:
    """The environment for ``claude -p`` against sluice only.

    Args:
        home: an empty folder to use as ``HOME``.
        base_url: sluice's root URL (Claude Code appends ``/v1/messages``).
        model: the model id for every request (main, small-fast and sub-agent models alike).

    Returns:
        The environment.
    """
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
