"""Each kind of steady-state check the library uses (a bool, a count, a latency range, an SLO met, an SLO's burn
rate), with the real probes against the real engine: the library's tolerances hold, and each one tightened past the
value the probe measured flips the verdict to NOT RUN, naming that check (``chaos.run.runner``, as ``kvstorm chaos run``
runs it, without the CLI).
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from chaos.run.runner import run_experiment_file


def probe(name: str, func: str, tolerance: Any, **arguments: Any) -> dict[str, Any]:
    provider = {"type": "python", "module": "chaos.probes", "func": func, "arguments": arguments}
    return {"type": "probe", "name": name, "tolerance": tolerance, "provider": provider}


# One check of each kind, with the tolerances of chaos/experiments/burst-with-vram-cap.yaml; the burn rate's is
# wide because the SLO file below makes the baseline burn the TTFT budget (a burn rate of 0 cannot be undercut).
PROBES = [
    probe("server-healthy", "server_healthy", True, target_url="${target_url}"),
    probe("leaked-kv-blocks", "leaked_kv_blocks", 0, target_url="${target_url}"),
    probe("ttft-p99-s", "load_latency", {"type": "range", "range": [0, 30]}, metric="ttft", stat="p99"),
    probe("engine-errors-slo-met", "slo_met", True, slo="errors"),
    probe("ttft-slo-burn-rate", "slo_burn_rate", {"type": "range", "range": [0, 1000]}, slo="ttft"),
]
EXPERIMENT = {
    "title": "every kind of check",
    "description": "The library's kinds of steady-state check around a two-second load.",
    "configuration": {
        "target_url": "http://127.0.0.1:1",  # the test passes the real one as a variable
        "model": "smollm2-135m",
        "baseline_requests": 2,
        "workload": "random",
        "input_len": "fixed:32",
        "output_len": "fixed:8",
    },
    "controls": [{"name": "kvstorm", "provider": {"type": "python", "module": "chaos.controls"}}],
    "steady-state-hypothesis": {"title": "the checks", "probes": PROBES},
    "method": [
        {
            "type": "action",
            "name": "load",
            "provider": {
                "type": "python",
                "module": "chaos.actions",
                "func": "run_load",
                "arguments": {
                    "target_url": "${target_url}",
                    "model": "${model}",
                    "arrival": "poisson:rate=2",
                    "duration_s": 2,
                    "workload": "${workload}",
                    "input_len": "${input_len}",
                    "output_len": "${output_len}",
                },
            },
        }
    ],
    "rollbacks": [],
}


def tightened(tolerance: Any, measured: Any) -> Any:
    """A tolerance of the same kind that ``measured`` no longer meets."""
    if isinstance(tolerance, bool):
        return not measured
    if isinstance(tolerance, int):
        return measured + 1
    if measured <= 0:
        raise ValueError(f"cannot tighten a range below {measured}")
    return {"type": "range", "range": [0, measured / 10]}


def run(directory: Path, url: str, probes: list[dict[str, Any]]):
    experiment = {**copy.deepcopy(EXPERIMENT), "steady-state-hypothesis": {"title": "the checks", "probes": probes}}
    path = directory / "experiment.yaml"
    path.write_text(yaml.safe_dump(experiment))
    slo_file = directory / "slo.yaml"
    slo_file.write_text("ttft: {threshold: 0.001, objective: 0.99}\n")  # every baseline request misses 1 ms
    variables = {"target_url": url, "model": "smollm2-135m"}
    return run_experiment_file(
        path, variables, directory / "results", console=Console(file=io.StringIO()), slo_file=slo_file
    )


@pytest.fixture(scope="module")
def measured(kvstorm_server, tmp_path_factory) -> dict[str, Any]:
    """What each probe measured on the baseline of a run that held."""
    experiment_run = run(tmp_path_factory.mktemp("held"), kvstorm_server.url, PROBES)
    verdict = experiment_run.verdict
    assert verdict.status == "held", verdict.reason
    assert experiment_run.load is not None
    return {check.name: check.before for check in verdict.checks}


@pytest.mark.parametrize("name", [p["name"] for p in PROBES])
def test_a_tolerance_tightened_past_the_measured_value_flips_the_verdict(name, measured, kvstorm_server, tmp_path):
    probes = copy.deepcopy(PROBES)
    (target,) = [p for p in probes if p["name"] == name]
    target["tolerance"] = tightened(target["tolerance"], measured[name])
    experiment_run = run(tmp_path, kvstorm_server.url, probes)
    verdict = experiment_run.verdict
    assert (verdict.status, verdict.exit_code) == ("not_run", 1), verdict.reason
    assert verdict.reason.startswith(f"the baseline misses {name} (")
    assert experiment_run.load is None, "no load after a baseline miss"
    assert experiment_run.journal["status"] == "failed", "kvstorm's control fails the journal"
    assert "NOT RUN" in (experiment_run.results_dir / "report.html").read_text()
    assert "NOT RUN" in (experiment_run.results_dir / "verdict.md").read_text().splitlines()[0]
