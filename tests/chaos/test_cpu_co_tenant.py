"""The noisy neighbour as a fault: processes on this host that keep cores busy (chaos.injectors.cpu_co_tenant),
bounded and ending by themselves, and the library's noisy-neighbour experiment through them against a real
``kvstorm serve``, which keeps the promise it states."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from chaos.injectors.cpu_co_tenant import CoTenantSpec, CpuCoTenant
from chaos.injectors.processes import kvstorm_server
from chaos.judgement.applicability import inapplicability
from chaos.run.runner import EXPERIMENTS_DIR

EXPERIMENT = EXPERIMENTS_DIR / "noisy-neighbour.yaml"


def busy_loops_running() -> int:
    """Co-tenant processes alive on this host (their program is recognisable in their command line)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"busy_until" in Path(f"/proc/{pid}/cmdline").read_bytes():
                count += 1
        except OSError:
            continue
    return count


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (CoTenantSpec(cores=0), "cores must be a whole number from 1"),
        (CoTenantSpec(cores=(os.cpu_count() or 1) + 1), "cores must be a whole number from 1"),
        (CoTenantSpec(duty_cycle=0), "duty_cycle must be in (0, 1]"),
        (CoTenantSpec(duty_cycle=1.5), "duty_cycle must be in (0, 1]"),
        (CoTenantSpec(duration_s=601), "duration_s must be in (0, 600]"),
    ],
)
def test_a_co_tenant_past_its_bounds_is_refused_by_name(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        CpuCoTenant(spec)


def test_a_co_tenant_uses_the_cpu_and_ends_by_itself_at_its_deadline_or_when_stopped():
    co_tenant = CpuCoTenant(CoTenantSpec(cores=1, duty_cycle=0.5, duration_s=1.0))
    started = time.monotonic()
    co_tenant.start()
    co_tenant.wait()
    assert time.monotonic() - started < 1.0 + 3  # its deadline, plus a process's start and exit
    assert co_tenant.num_running == 0
    long = CpuCoTenant(CoTenantSpec(cores=1, duration_s=300))
    long.start()
    time.sleep(0.5)
    assert long.num_running == 1
    assert busy_loops_running() >= 1
    assert long.stop() == 1
    assert long.num_running == 0


def test_a_co_tenant_cannot_reach_a_server_on_another_host_so_the_experiment_is_not_applicable_there():
    experiment = yaml.safe_load(EXPERIMENT.read_text())
    reason = inapplicability(experiment, "http://10.11.12.13:8000")
    assert reason is not None
    assert "busy-neighbour" in reason
    assert "not on it" in reason


def test_the_noisy_neighbour_experiment_holds_on_kvstorm_with_its_promise_kept_and_leaves_no_process(tmp_path):
    """kvstorm serve with its defaults (admission on, its 10 s objective stated) under a steady load at 1 request/s;
    one core kept busy from 4 s for 10 s of the 20 s load."""
    settings = {
        "rate_unit": "req/s",
        "arrival": "poisson:rate=1",
        "duration_s": 20,
        "co_tenant_after_s": 4,
        "co_tenant_for_s": 10,
        "baseline_requests": 2,
    }
    variables = [f"--var={key}={value}" for key, value in settings.items()]
    with kvstorm_server(("--num-kv-blocks", "88"), tmp_path / "server.log") as server:
        run = subprocess.run(
            [sys.executable, "-m", "kvstorm", "chaos", "run", str(EXPERIMENT), "--target", server.url,
             "--results-dir", str(tmp_path / "results"), *variables],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    (run_dir,) = (tmp_path / "results").iterdir()
    verdict = (run_dir / "verdict.md").read_text()
    assert run.returncode == 0, verdict
    assert "| cpu:co-tenant |" in verdict
    assert re.search(
        r"\| stated-ttft-promise-kept \| .*? \| kept: .*? \| kept: admitted TTFT p95 [\d.]+ s against the stated 10 s",
        verdict,
    ), verdict
    assert busy_loops_running() == 0
