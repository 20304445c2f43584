"""Machine load around a benchmark: who else used the CPU while we measured.

On a shared 2-core machine a neighbour taking a core slows an OpenMP decode many times over, so
every measurement records the load average and the CPU other processes used around it, and a
repeat above ``--max-others`` cores is flagged and retried. Standard library only: the llama.cpp
child of ``vs_llamacpp.py`` imports it from another venv.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def emit(row: dict[str, Any]) -> None:
    """Print one measurement as a JSON line."""
    print(json.dumps(row), flush=True)


def _busy_s() -> float:
    """CPU seconds all processes spent running (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / TICK


def _pid_stat(pid: int | str) -> tuple[float, int]:
    """(CPU seconds of one process, all threads; its nice value); (0, 0) when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces: fields after its closing parenthesis.
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0
    return (int(rest[11]) + int(rest[12])) / TICK, int(rest[16])


def cpu_seconds(pid: int) -> float:
    """CPU seconds of one process, all threads (0 once it is gone)."""
    return _pid_stat(pid)[0]


def _niced_cpu_s(exclude: set[int]) -> dict[int, float]:
    """CPU seconds of every live niced (nice > 0) process outside ``exclude``, by pid."""
    out: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in exclude:
            cpu, nice = _pid_stat(name)
            if nice > 0:
                out[int(name)] = cpu
    return out


@contextmanager
def load_probe(pids: list[int], out: dict[str, Any]) -> Iterator[None]:
    """Record into ``out`` the load average and other processes' CPU cores around a block.

    ``pids`` are our processes (this one is always included): their CPU is subtracted from the
    machine's busy time, what remains is the neighbours' (``others_cores``). ``niced_cores`` is
    the part of it taken by niced processes alive at both ends, for information only: a nice-19
    CI build still slowed llama.cpp's spinning thread pool 3x, so niced CPU counts as load.
    """
    ours = [os.getpid(), *pids]
    load0, busy0, wall0 = os.getloadavg()[0], _busy_s(), time.perf_counter()
    own0 = sum(_pid_stat(p)[0] for p in ours)
    niced0 = _niced_cpu_s(set(ours))
    yield
    wall = time.perf_counter() - wall0
    own = sum(_pid_stat(p)[0] for p in ours) - own0
    niced1 = _niced_cpu_s(set(ours))
    niced = sum(niced1[p] - niced0[p] for p in niced1.keys() & niced0.keys())
    out["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    out["own_cores"] = round(own / wall, 2)
    out["others_cores"] = round(max(0.0, _busy_s() - busy0 - own) / wall, 2)
    out["niced_cores"] = round(niced / wall, 2)


def decode_rate(runs: list[list[tuple[float, int]]]) -> tuple[float, int, float]:
    """Aggregate decode rate of concurrent streams from per-stream (time, tokens) records.

    Returns (tok/s, tokens counted, span): tokens produced strictly after the last stream's
    first token, over the time from then to the last token of any stream.
    """
    t0 = max(r[0][0] for r in runs)
    t1 = max(r[-1][0] for r in runs)
    n = sum(k for r in runs for t, k in r if t > t0)
    return n / (t1 - t0), n, t1 - t0


def is_clean(row: dict[str, Any], max_others: float) -> bool:
    """Whether other processes (niced ones included) used at most ``max_others`` cores."""
    return float(row["others_cores"]) <= max_others


def attempts(repeats: int, max_others: float, done: list[dict[str, Any]]) -> Iterator[int]:
    """Repeat indices until ``done`` holds ``repeats`` clean rows, at most ``2 * repeats``.

    The caller appends each measured row to ``done``: a repeat spoiled by a neighbour is retried
    instead of being averaged in.
    """
    for rep in range(2 * repeats):
        if sum(is_clean(r, max_others) for r in done) >= repeats:
            return
        yield rep
