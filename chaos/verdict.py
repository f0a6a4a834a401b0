"""The verdict of one experiment: every steady-state check before and after the method, and what the run did.

Built from the Chaos Toolkit journal (so it says what the stock ``chaos run`` decided) plus the run's state (loads,
fault windows, recovery). Chaos Toolkit stops a hypothesis at its first failing probe; the probes it skipped after
the method are evaluated here too, and marked so, because a verdict that names one miss and hides the rest
misleads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chaoslib.activity import run_activity
from chaoslib.hypothesis import within_tolerance

from chaos.metrics import EngineActivity, time_to_recover
from chaos.slo_check import SloResult, evaluate_all, run_spec
from chaos.state import RunState
from loadgen.analysis import Summary
from loadgen.results import FaultWindow

SECONDS_PROBES = ("load_latency", "settled")


@dataclass(frozen=True)
class Check:
    name: str
    expectation: str
    before: Any
    after: Any
    met: bool | None  # None: never evaluated (the method did not run)
    # Evaluated for the verdict after Chaos Toolkit stopped at an earlier failing probe.
    evaluated_late: bool = False


@dataclass(frozen=True)
class Verdict:
    title: str
    status: str  # held, deviated, failed_before, aborted, interrupted
    reason: str
    checks: list[Check]
    load: Summary | None = None
    activity: EngineActivity | None = None
    recovery_s: float | None = None
    fault_windows: list[FaultWindow] = field(default_factory=list)
    restarts_s: list[float] = field(default_factory=list)
    storms: list[dict[str, Any]] = field(default_factory=list)
    # The dashboards' SLO spec over the main load (chaos.slo_check), and its profile.
    slos: list[SloResult] = field(default_factory=list)
    slo_profile: str = ""

    @property
    def held(self) -> bool:
        return self.status == "held"

    @property
    def exit_code(self) -> int:
        """0: the steady state held; 1: it did not (before or after); 2: the run itself failed."""
        return {"held": 0, "deviated": 1, "failed_before": 1}.get(self.status, 2)


def build_verdict(journal: Mapping[str, Any], state: RunState, configuration: Mapping[str, Any]) -> Verdict:
    experiment = journal["experiment"]
    probes = (experiment.get("steady-state-hypothesis") or {}).get("probes", [])
    before = _runs_by_name(journal["steady_states"].get("before"))
    after = _runs_by_name(journal["steady_states"].get("after"))
    status, reason = _status(journal, before, after)
    method_ran = status in ("held", "deviated")
    checks = []
    for probe in probes:
        name = probe["name"]
        run_before, run_after = before.get(name), after.get(name)
        late = method_ran and run_after is None
        if late:
            run_after = _evaluate(probe, configuration)
        checks.append(
            Check(
                name=name,
                expectation=describe_tolerance(probe),
                before=None if run_before is None else run_before.get("output"),
                after=None if run_after is None else run_after.get("output"),
                met=None if run_after is None else bool(run_after.get("tolerance_met")),
                evaluated_late=late,
            )
        )
    main = state.main_load()
    activity, slos = None, []
    if main is not None and main.metrics_before is not None and main.metrics_after is not None:
        activity = EngineActivity.between(main.metrics_before, main.metrics_after)
        slos = evaluate_all(run_spec(), main)
    return Verdict(
        title=experiment.get("title", ""),
        status=status,
        reason=reason,
        checks=checks,
        load=main.result.summary if main is not None and main.result is not None else None,
        activity=activity,
        recovery_s=None if main is None else time_to_recover(main.samples, state.fault_windows),
        fault_windows=list(state.fault_windows),
        restarts_s=list(state.restarts),
        storms=[storm.to_json() for storm in state.storms],
        slos=slos,
        slo_profile=state.slo_profile,
    )


def describe_tolerance(probe: Mapping[str, Any]) -> str:
    tolerance = probe.get("tolerance")
    unit = " s" if probe.get("provider", {}).get("func") in SECONDS_PROBES else ""
    if isinstance(tolerance, bool):
        return "true" if tolerance else "false"
    if isinstance(tolerance, int):
        return f"= {tolerance}"
    if isinstance(tolerance, dict) and tolerance.get("type") == "range":
        tolerance = tolerance["range"]
    if isinstance(tolerance, list) and len(tolerance) == 2:
        low, high = tolerance
        return f"<= {high:g}{unit}" if low == 0 else f"{low:g} to {high:g}{unit}"
    return str(tolerance)


def _runs_by_name(state: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    return {run["activity"]["name"]: run for run in (state or {}).get("probes", [])}


def _status(journal: Mapping[str, Any], before: Mapping, after: Mapping) -> tuple[str, str]:
    failed = next((name for name, run in after.items() if not run.get("tolerance_met")), None)
    if journal.get("deviated"):
        return "deviated", f"the steady state did not hold after the method: {failed}"
    status = journal.get("status")
    if status == "failed":
        missed = next((name for name, run in before.items() if not run.get("tolerance_met")), "a probe")
        return "failed_before", f"the steady state did not hold before the method ({missed}): nothing was injected"
    if status in ("aborted", "interrupted"):
        failed_activity = next((r["activity"]["name"] for r in journal.get("run", []) if r["status"] == "failed"), None)
        cause = f": {failed_activity} failed" if failed_activity else ""
        return status, f"the experiment was {status}{cause}"
    return "held", "every steady-state check held before and after the method"


def _evaluate(probe: Mapping[str, Any], configuration: Mapping[str, Any]) -> dict[str, Any]:
    try:
        output = run_activity(dict(probe), dict(configuration), {})
    except Exception as error:
        return {"output": f"failed: {error}", "tolerance_met": False}
    met = within_tolerance(probe["tolerance"], output, configuration=dict(configuration), secrets={})
    return {"output": output, "tolerance_met": met}
