"""Helpers of the load-generation tests: the scripted server and ``kvstorm bench serve``, each in its own process.

Own processes, because the client under test must not share an event loop (or a GIL) with the yardstick it is
measured against; both start at timing priority (:func:`loadgen.scripted_server.prioritize_timing`): the machine is
shared, and a yardstick that waits for a CPU behind someone else's compiler bends by a scheduler slice (3 ms and
more).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loadgen.scripted_server import prioritize_timing, scripted_server_process

REPO_ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def scripted_server(*args: str):
    """The scripted server with ARGS, in its own process (the repository on its path)."""
    return scripted_server_process(*args, env=child_env())


def run_bench_serve(base_url: str, results_dir: Path, *args: str, timeout_s: float = 120) -> Path:
    """``kvstorm bench serve`` as a user runs it (its own process); returns the results JSON it wrote."""
    return run_bench_serve_with_output(base_url, results_dir, *args, timeout_s=timeout_s)[0]


def run_bench_serve_with_output(
    base_url: str, results_dir: Path, *args: str, timeout_s: float = 120
) -> tuple[Path, str]:
    """The same, and what it printed."""
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--base-url", base_url, "--model", "m"]
    result = subprocess.run(
        [*command, "--results-dir", str(results_dir), "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=child_env(),
        preexec_fn=prioritize_timing,
        start_new_session=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (json_path,) = results_dir.glob("*.json")
    return json_path, result.stdout
