"""The queue poll's retry pacing: the delay a log line states is the gap the attempts keep."""

from __future__ import annotations

import itertools

import pytest

from services.queue.poll_backoff import POLL_BACKOFF_MAX_S, Backoff


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_attempts_start_the_stated_delay_apart_even_when_an_attempt_is_slow() -> None:
    clock = _Clock()
    backoff = Backoff(first_s=0.05, max_s=2.0, clock=clock)
    starts: list[float] = []
    stated: list[float] = []
    for took in [0.0, 0.3, 1.0, 1.0, 1.0, 1.0, 0.0]:  # e.g. connects that hang, then time out
        starts.append(clock.now)
        clock.now += took
        wait = backoff.failed(starts[-1])
        stated.append(backoff.delay_s)
        clock.now += wait  # the sleep the log line states
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # An attempt that took longer than its delay is followed at once; otherwise the gap is exact.
    expected = [max(d, t) for d, t in zip(stated, [0.0, 0.3, 1.0, 1.0, 1.0, 1.0], strict=False)]
    assert gaps == pytest.approx(expected)
    assert stated[-1] == 2.0


def test_the_cap_bounds_the_reconnect_delay_and_success_resets() -> None:
    clock = _Clock()
    backoff = Backoff(clock=clock)
    for _ in range(20):
        backoff.failed(clock.now)
    assert backoff.delay_s == POLL_BACKOFF_MAX_S <= 0.5
    assert backoff.succeeded() and not backoff.succeeded()
    assert backoff.failed(clock.now) == pytest.approx(backoff.first_s)


def test_a_long_outage_logs_once_in_a_while() -> None:
    clock = _Clock()
    backoff = Backoff(clock=clock)
    logged = 0
    for _ in range(200):  # 100 s at the cap
        clock.now += backoff.failed(clock.now)
        logged += backoff.log_due()
    assert 10 <= logged <= 20
