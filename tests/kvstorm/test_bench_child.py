"""The one child runner of the benchmarks: a function runs in a fresh process and its dataclass comes back typed; a
failure or a timeout ends the child and says what happened."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

from kvstorm.bench.child import measure_in_child, run_in_child


@dataclass(frozen=True)
class Echo:
    pid: int
    doubled: list[float]


def echo_in_child(values: list[float]) -> Echo:
    return Echo(os.getpid(), [2 * v for v in values])


def fail_in_child(reason: str) -> Echo:
    raise ValueError(reason)


def sleep_in_child(seconds: float) -> Echo:
    time.sleep(seconds)
    return Echo(os.getpid(), [])


def test_a_function_runs_in_its_own_process_and_its_result_comes_back_typed():
    result, run = measure_in_child(echo_in_child, Echo, values=[1.5, 2.0])
    assert result == Echo(result.pid, [3.0, 4.0])
    assert result.pid != os.getpid()
    assert run.exit_code == 0
    assert run.peak_rss_mib > 0


def test_a_failing_child_raises_with_its_error_and_a_slow_one_is_ended_at_its_timeout():
    with pytest.raises(RuntimeError, match=r"exited with 1 in its child process:(.|\n)*ValueError: out of blocks"):
        run_in_child(fail_in_child, Echo, reason="out of blocks")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        run_in_child(sleep_in_child, Echo, timeout_s=1.0, seconds=60.0)
    assert time.monotonic() - start < 30  # a hang guard, not a speed target
