"""Child processes of ``sluice up``: spawning them tied to the launcher, and stopping them.

Owns the process-group and parent-death-signal set-up every child gets, the SIGTERM-then-SIGKILL
stop, and the ``sluice up:`` note format, so the launcher and the private Redis it may start
handle their children the same way.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time

__all__ = ["describe", "note", "spawn", "terminate"]


def spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group, to be stopped when the launcher dies.

    Args:
        cmd: the argument vector.
        env: the child's environment.

    Returns:
        The running child.
    """
    # Own process group: a terminal's Ctrl-C reaches only the launcher, which forwards one
    # SIGTERM, instead of every child getting SIGINT plus our forward (uvicorn force-exits on
    # the second signal). The parent-death signal stops children if the launcher is killed -9.
    return subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def terminate(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every live process, wait up to ``grace_s`` in total, then SIGKILL stragglers.

    Args:
        procs: the children to stop (already exited ones are only reaped).
        grace_s: total seconds to wait for all of them after SIGTERM.
    """
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            note(f"{describe(proc)} ignored SIGTERM for {grace_s:.0f} s; killing it")
            proc.kill()
            proc.wait()


def describe(proc: subprocess.Popen[bytes]) -> str:
    """A short name for log lines: the ``services.cli`` subcommand, else the program.

    Args:
        proc: a child started by ``spawn``.

    Returns:
        E.g. ``worker (pid 4242)``.
    """
    args = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    words = [str(a) for a in args]
    name = words[3] if len(words) > 3 and words[1:3] == ["-m", "services.cli"] else words[0]
    return f"{name} (pid {proc.pid})"


def note(message: str) -> None:
    """Print a launcher status line to stderr.

    Args:
        message: the text after the ``sluice up:`` prefix.
    """
    print(f"sluice up: {message}", file=sys.stderr, flush=True)
