"""Helpers of the load-generation tests: the scripted server and ``kvstorm bench serve``, each in its own process.

Own processes, because the client under test must not share an event loop (or a GIL) with the yardstick it is
measured against. Both run in a new session at real-time priority (SCHED_FIFO 1) where the tests may set it (root:
CI and the dev machines), else at nice -10 where allowed, else as they are. The machine is shared: a yardstick
that waits for a CPU behind someone else's compiler bends by a whole scheduler slice (3 ms and more), and nice alone
does not help across sessions (the kernel groups CPU time per session). Both processes sleep most of the time
(well under one core each), and the kernel caps real-time tasks at 95% of a CPU, so nothing else starves.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def raise_priority() -> None:
    """preexec_fn of the timing-sensitive children (started with ``start_new_session=True``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError:
        with contextlib.suppress(OSError):
            os.nice(-10)


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


class ScriptedServer:
    def __init__(self, process: subprocess.Popen, base_url: str) -> None:
        self.process, self.base_url = process, base_url

    def script_log(self) -> dict[str, dict]:
        """The server's log of every request, by X-Request-Id."""
        with urllib.request.urlopen(self.base_url + "/script-log", timeout=30) as response:
            return {entry["request_id"]: entry for entry in json.load(response)}


@contextlib.contextmanager
def scripted_server(*args: str) -> Iterator[ScriptedServer]:
    """``python -m loadgen.scripted_server ARGS`` on a free loopback port, terminated on exit."""
    process = subprocess.Popen(
        [sys.executable, "-m", "loadgen.scripted_server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        preexec_fn=raise_priority,
        start_new_session=True,
    )
    try:
        line = process.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"scripted server did not start: {line!r}")
        yield ScriptedServer(process, "http://" + line.removeprefix("listening on ").strip())
    finally:
        process.terminate()
        process.wait(timeout=10)


def run_bench_serve(base_url: str, results_dir: Path, *args: str, timeout_s: float = 120) -> Path:
    """``kvstorm bench serve`` as a user runs it (its own process); returns the results JSON it wrote."""
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--base-url", base_url, "--model", "m"]
    result = subprocess.run(
        [*command, "--results-dir", str(results_dir), "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=child_env(),
        preexec_fn=raise_priority,
        start_new_session=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (json_path,) = results_dir.glob("*.json")
    return json_path
