"""``sluice up`` end to end: real child processes, a real Redis, a real HTTP request.

The launcher runs as a subprocess exactly as ``./ops/run`` execs it, with the scripted test
double as its model, on free ports. Each test waits for the printed curl line (the launcher
prints it only after /readyz answers 200), then stops the launcher with a signal.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest
import redis as redis_sync

from shared import keys
from shared.codec import decode_entries
from tests.invariants import check_stream

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Launcher:
    """A ``sluice up`` child whose output lines are collected by reader threads."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.transcript: list[str] = []
        self.pumps = [
            threading.Thread(target=self._pump, args=(name, stream), daemon=True)
            for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr))
        ]
        for pump in self.pumps:
            pump.start()

    def _pump(self, name: str, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self.lines.put((name, line.rstrip("\n")))

    def wait_for(self, pattern: str, stream: str = "out") -> re.Match[str] | None:
        """The first line on ``stream`` matching ``pattern``; None if the launcher exits first."""
        deadline = time.monotonic() + START_TIMEOUT_S  # a hang guard, not a measured threshold
        while time.monotonic() < deadline:
            try:
                name, line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if not any(t.is_alive() for t in self.pumps) and self.lines.empty():
                    return None  # both pipes closed: the launcher is gone
                continue
            self.transcript.append(line)
            if name == stream and (match := re.search(pattern, line)):
                return match
        pytest.fail(f"no {pattern!r} within {START_TIMEOUT_S} s:\n{self.text()}")

    def text(self) -> str:
        while not self.lines.empty():
            self.transcript.append(self.lines.get()[1])
        return "\n".join(self.transcript)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"sluice up ignored SIGTERM:\n{self.text()}")


@pytest.fixture
def launch() -> Iterator[list[Launcher]]:
    started: list[Launcher] = []
    yield started
    for launcher in started:
        if launcher.proc.poll() is None:
            # SIGTERM lets the launcher stop its children; a SIGKILL would orphan any child
            # that ignores the parent-death SIGTERM.
            launcher.proc.send_signal(signal.SIGTERM)
            try:
                launcher.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.proc.kill()
                launcher.proc.wait()


def _env(redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    return {**env, "SLUICE_REDIS_URL": redis_url, "SLUICE_LOG_LEVEL": "warning"}


def test_up_with_private_redis_serves_the_printed_curl_line(launch: list[Launcher]) -> None:
    dead_url = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    port = _free_port()
    launcher = Launcher(["--model", "scripted:text", "--port", str(port)], _env(dead_url))
    launch.append(launcher)

    private = launcher.wait_for(r"started a private one at (unix://\S+)", stream="err")
    assert private is not None, launcher.text()
    socket_path = Path(private.group(1).removeprefix("unix://"))
    assert socket_path.parent == ROOT / "run"
    curl = launcher.wait_for(r"^curl ")
    assert curl is not None, launcher.text()

    # Run the printed line's request as curl would: same URL, same headers, same body.
    argv = shlex.split(curl.string)
    url, body = argv[1], argv[argv.index("-d") + 1]
    assert url == f"http://127.0.0.1:{port}/v1/chat/completions"
    reply = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 200, reply.text
    completion = reply.json()
    assert completion["choices"][0]["message"]["content"]
    assert completion["choices"][0]["finish_reason"] == "stop"

    # The request's event log lives in the private Redis: it must be a valid stream.
    client = redis_sync.Redis(unix_socket_path=str(socket_path))
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(  # type: ignore[assignment]
            keys.events(completion["id"])
        )
    finally:
        client.close()
    check_stream(decode_entries(entries))

    # The private Redis dies: the launcher starts it again, the worker and the API ride it out.
    client = redis_sync.Redis(unix_socket_path=str(socket_path))
    try:
        os.kill(int(client.info("server")["process_id"]), signal.SIGKILL)
    finally:
        client.close()
    assert launcher.wait_for(r"restarted the private Redis", stream="err"), launcher.text()
    deadline = time.monotonic() + START_TIMEOUT_S  # a hang guard: the worker re-registers
    while httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, launcher.text()
        time.sleep(0.1)
    again = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert again.status_code == 200, again.text
    assert (
        again.json()["choices"][0]["message"]["content"]
        == completion["choices"][0]["message"]["content"]
    )

    assert launcher.stop() == 0, launcher.text()
    assert not socket_path.exists(), "the private Redis socket outlived the launcher"


@pytest.fixture
def clean_db(redis_url: str) -> Iterator[str]:
    """The test database, flushed before and after (the worker registers itself there)."""
    client = redis_sync.Redis.from_url(redis_url)
    client.flushdb()
    yield redis_url
    client.flushdb()
    client.close()


def test_up_stops_everything_when_a_child_dies(launch: list[Launcher], clean_db: str) -> None:
    # The worker cannot load an unknown scripted scenario, so that child exits at start-up.
    args = ["--model", "scripted:no-such-scenario", "--port", str(_free_port())]
    launcher = Launcher(args, _env(clean_db))
    launch.append(launcher)
    assert launcher.wait_for(r"^curl ") is None
    rc = launcher.proc.wait(timeout=30)
    output = launcher.text()
    assert rc != 0, output
    assert re.search(r"worker \(pid \d+\) exited with status", output), output
    # Redis answered at the test URL, so no private server was started.
    assert "started a private one" not in output
