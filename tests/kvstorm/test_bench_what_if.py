"""`kvstorm bench what-if` end to end on the shipped H200 profile: it finds the rate where preemption starts, and at
that rate a KV cap, without admission control and with it: admission refuses what would miss its objective, so the
admitted requests' first tokens come within it where, unguarded, the queue grows."""

from __future__ import annotations

import subprocess
import sys


def rows_of(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "run":
            rows.setdefault(cells[0], cells)
    return rows


def test_a_kv_cap_at_the_onset_of_preemption_with_and_without_admission():
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "what-if", "--duration", "60s"]
    command += ["--ttft-slo", "5s"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "A prediction, not a measurement" in run.stdout
    rows = rows_of(run.stdout)
    onset, unguarded, guarded = rows["at the onset"], rows["30% cap, middle third"], rows["30% cap, admission at 5 s"]
    assert int(onset[2].split()[0]) > 0, "preemption starts at the rate it names"
    assert onset[1] == unguarded[1] == guarded[1]
    # Columns: rate, preemptions, TTFT p50, TTFT p99, TPOT p50, output tok/s, refused, broken, timed out.
    assert float(unguarded[4]) > 5.0, "unguarded, the capped pool's queue delays first tokens past the objective"
    assert float(guarded[4]) <= 5.0
    assert int(guarded[7]) > int(unguarded[7]), "admission refuses what would miss the objective"
