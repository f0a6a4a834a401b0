"""Chaos experiments end to end against the real engine: ``kvstorm chaos run`` and the stock ``chaos run`` on the same
file agree, the verdict passes when the steady state holds and fails when an SLO is really violated, and the
rollbacks leave no fault on the engine.

The library's "burst with a VRAM cap" runs shortened (a 10 s load, a 10% cap for 4 s) through ``--var``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chaos.runner import EXPERIMENTS_DIR

EXPERIMENT = EXPERIMENTS_DIR / "burst-with-vram-cap.yaml"
SHORT = {
    "input_len": "fixed:64",
    "output_len": "fixed:16",
    "arrival": "poisson:rate=2",
    "duration_s": 10,
    "cap_after_s": 2,
    "cap_for_s": 4,
    "cap_fraction": 0.1,
    "baseline_requests": 2,
}
CHAOS_CLI = Path(sys.executable).with_name("chaos")


def tight_ttft_experiment(directory: Path) -> Path:
    """The same experiment with a TTFT SLO (1 s at p99) that the calm baseline meets and the capped burst cannot:
    a 10% cap runs one request at a time while two arrive every second."""
    experiment = yaml.safe_load(EXPERIMENT.read_text())
    for probe in experiment["steady-state-hypothesis"]["probes"]:
        if probe["name"] == "ttft-p99-s":
            probe["tolerance"] = {"type": "range", "range": [0, 1.0]}
    path = directory / "tight-ttft.yaml"
    path.write_text(yaml.safe_dump(experiment))
    return path


def kvstorm_chaos_run(path: Path, url: str, results: Path) -> tuple[int, Path]:
    variables = [f"--var={key}={value}" for key, value in SHORT.items()]
    command = [
        sys.executable,
        "-m",
        "kvstorm",
        "chaos",
        "run",
        str(path),
        "--target",
        url,
        "--results-dir",
        str(results),
    ]
    result = subprocess.run([*command, *variables], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    (run_dir,) = results.iterdir()
    return result.returncode, run_dir


def stock_chaos_run(path: Path, url: str, workdir: Path) -> tuple[int, dict]:
    # The stock CLI takes a number as text unless typed (key:int=value).
    types = {int: ":int", float: ":float", str: ""}
    variables = [f"--var={key}{types[type(value)]}={value}" for key, value in {**SHORT, "target_url": url}.items()]
    journal = workdir / "journal.json"
    command = [str(CHAOS_CLI), "run", "--rollback-strategy", "always", "--journal-path", str(journal), *variables]
    result = subprocess.run(
        [*command, str(path)], capture_output=True, text=True, timeout=600, cwd=workdir, check=False
    )
    return result.returncode, json.loads(journal.read_text())


def assert_no_fault_left(kvstorm_server) -> None:
    faults = kvstorm_server.admin.faults()
    assert (faults["kv_cap"], faults["lease_s"]) == (None, None)


def test_the_vram_cap_experiment_holds_and_both_clis_say_so(kvstorm_server, tmp_path):
    code, run_dir = kvstorm_chaos_run(EXPERIMENT, kvstorm_server.url, tmp_path / "kvstorm")
    assert code == 0
    verdict = (run_dir / "verdict.md").read_text()
    assert "HELD" in verdict
    assert "engine:kv_cap" in verdict
    journal = json.loads((run_dir / "journal.json").read_text())
    assert (journal["status"], journal["deviated"]) == ("completed", False)
    report = (run_dir / "report.html").read_text()
    assert "engine:kv_cap" in report  # the fault window drawn as a band
    load = json.loads((run_dir / "load.json").read_text())
    assert load["summary"]["outcomes"]["ok"] == load["summary"]["num_requests"] > 0
    assert "| preemptions | 0 |" not in verdict, "a 10% cap must preempt"
    assert_no_fault_left(kvstorm_server)

    workdir = tmp_path / "stock"
    workdir.mkdir()
    stock_code, stock_journal = stock_chaos_run(EXPERIMENT, kvstorm_server.url, workdir)
    assert (stock_code, stock_journal["status"], stock_journal["deviated"]) == (0, "completed", False)
    assert_no_fault_left(kvstorm_server)


def test_a_violated_slo_fails_the_verdict_in_both_clis_and_the_rollback_still_clears_the_cap(kvstorm_server, tmp_path):
    path = tight_ttft_experiment(tmp_path)
    code, run_dir = kvstorm_chaos_run(path, kvstorm_server.url, tmp_path / "kvstorm")
    assert code == 1
    verdict = (run_dir / "verdict.md").read_text()
    headline = verdict.splitlines()[0]
    assert "DEVIATED" in headline
    assert "ttft-p99-s" in headline
    journal = json.loads((run_dir / "journal.json").read_text())
    assert journal["deviated"] is True
    before = {run["activity"]["name"]: run for run in journal["steady_states"]["before"]["probes"]}
    assert before["ttft-p99-s"]["tolerance_met"], "the calm baseline met the SLO: the burst under the cap broke it"
    assert_no_fault_left(kvstorm_server)

    workdir = tmp_path / "stock"
    workdir.mkdir()
    stock_code, stock_journal = stock_chaos_run(path, kvstorm_server.url, workdir)
    assert stock_code != 0
    assert (stock_journal["status"], stock_journal["deviated"]) == (journal["status"], True)
    assert_no_fault_left(kvstorm_server)


@pytest.mark.parametrize("path", sorted(EXPERIMENTS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_library_experiment_is_valid_for_chaos_toolkit(path):
    from chaoslib.experiment import ensure_experiment_is_valid
    from chaoslib.loader import load_experiment

    experiment = load_experiment(str(path))
    ensure_experiment_is_valid(experiment)
    assert len(" ".join(experiment["description"].split())) > 200, "one paragraph: the production failure"
