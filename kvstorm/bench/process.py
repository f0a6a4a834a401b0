"""Runs a benchmark's program as a child process and measures it from outside: wall time, peak RSS."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ChildRun:
    exit_code: int | None  # None: killed at the timeout
    wall_s: float
    peak_rss_mib: float  # the child's own ru_maxrss, from wait4
    output: str  # stdout and stderr together


def run_child(command: list[str], timeout_s: float | None = None) -> ChildRun:
    with tempfile.TemporaryFile("w+") as output:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        timed_out = False
        if timeout_s is None:
            waited = os.wait4(process.pid, 0)
        else:
            deadline = time.monotonic() + timeout_s
            while (waited := os.wait4(process.pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    process.kill()
                    waited = os.wait4(process.pid, 0)
                    timed_out = True
                    break
                time.sleep(0.5)
        wall_s = time.perf_counter() - start
        _, status, usage = waited
        output.seek(0)
        return ChildRun(
            exit_code=None if timed_out else os.waitstatus_to_exitcode(status),
            wall_s=wall_s,
            peak_rss_mib=usage.ru_maxrss / 1024,
            output=output.read(),
        )
