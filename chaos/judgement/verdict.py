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

from chaos.injectors.disconnects import NOT_EXPORTED
from chaos.judgement.slo_check import SloResult, evaluate_all, run_spec
from chaos.run.metrics import EngineActivity, PrefixCachePhases, prefix_cache_phases, time_to_recover
from chaos.run.sizing import TargetSize
from chaos.run.state import RunState
from loadgen.analysis import LatencyStats, PrefixReuse, Summary, prefix_reuse
from loadgen.records import Outcome
from loadgen.results import FaultWindow, RunResult

SECONDS_PROBES = ("load_latency", "settled", "prefix_cache_recovery_s")
# Every status a verdict can have, with its exit status: 0 only for HELD; 1 when the steady state was missed (before
# the method: NOT RUN, nothing was injected; after it: DEVIATED); 2 when the run itself did not go through.
STATUSES = {
    "held": 0,  # the method ran, every check was met before and after it
    "not_run": 1,  # a check missed before the method: Chaos Toolkit stopped, no load, no fault
    "deviated": 1,  # every check was met before the method, one missed after it
    "failed": 2,  # Chaos Toolkit marked the run failed with no check missed
    "aborted": 2,  # an activity of the method failed and stopped it
    "interrupted": 2,  # a signal (Ctrl-C, the controller's stop) or an exit stopped it
    "unknown": 2,  # a journal without the evidence for any of the above: never HELD
    "not_applicable": 2,  # the server cannot take the experiment (no /admin/faults for its engine faults)
}


@dataclass(frozen=True)
class Check:
    name: str
    expectation: str
    before: Any
    after: Any
    met: bool | None  # after the method; None: never evaluated (the method did not run)
    # Evaluated for the verdict after Chaos Toolkit stopped at an earlier failing probe.
    evaluated_late: bool = False
    # Before the method (on the calm baseline); None: not evaluated (Chaos Toolkit stopped at an earlier miss).
    met_before: bool | None = None


@dataclass(frozen=True)
class LoadPhase:
    """The main load's ok requests sent in one phase of a run: their TTFT, and the prompt tokens they shared with
    earlier requests and the server said it served from its cache (their usage; None when they share nothing)."""

    ttft: LatencyStats | None
    reuse: PrefixReuse | None


@dataclass(frozen=True)
class Verdict:
    """What one run established. ``status`` is a key of ``STATUSES`` (``judge``), ``reason`` says why in words."""

    title: str
    status: str
    reason: str
    checks: list[Check]
    load: Summary | None = None
    activity: EngineActivity | None = None
    recovery_s: float | None = None
    # The prefix cache before, during and after the faults (None: no fault, or no such counters).
    prefix_cache: PrefixCachePhases | None = None
    # The main load's ok requests sent before the first fault, while faults were on, and after the last.
    load_phases: tuple[LoadPhase, LoadPhase, LoadPhase] | None = None
    fault_windows: list[FaultWindow] = field(default_factory=list)
    restarts_s: list[float] = field(default_factory=list)
    storms: list[dict[str, Any]] = field(default_factory=list)
    # The dashboards' SLO spec over the main load (chaos.judgement.slo_check), and its profile.
    slos: list[SloResult] = field(default_factory=list)
    slo_profile: str = ""
    # The main load's arrival as sent (after sizing), and what the server measured as before it (chaos.run.sizing).
    arrival: str | None = None
    target_size: TargetSize | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"verdict status {self.status!r}: expected one of {', '.join(STATUSES)}")

    @property
    def held(self) -> bool:
        return self.status == "held"

    @property
    def exit_code(self) -> int:
        """0: the steady state held; 1: it did not (before or after the method); 2: the run itself failed."""
        return STATUSES[self.status]


def build_verdict(journal: Mapping[str, Any], state: RunState, configuration: Mapping[str, Any]) -> Verdict:
    """The verdict of a finished run: its status from the journal (``judge``), each check before and after, and
    what ``state`` recorded (the main load, the server's activity, fault windows). After a miss past the method it
    runs the probes Chaos Toolkit skipped (with ``configuration``); a probe that raises there is a missed check."""
    experiment = journal["experiment"]
    probes = (experiment.get("steady-state-hypothesis") or {}).get("probes", [])
    before = _runs_by_name(journal["steady_states"].get("before"))
    after = _runs_by_name(journal["steady_states"].get("after"))
    status, reason = judge(journal)
    checks = []
    for probe in probes:
        name = probe["name"]
        run_before, run_after = before.get(name), after.get(name)
        # Only once the hypothesis after the method has run and stopped at a miss: never on a run that did not
        # reach it (the probes would measure the baseline again and pass it off as the experiment's load).
        late = status == "deviated" and journal["steady_states"].get("after") is not None and run_after is None
        if late:
            run_after = _evaluate(probe, configuration)
        checks.append(
            Check(
                name=name,
                expectation=describe_tolerance(probe),
                before=None if run_before is None else run_before.get("output"),
                after=None if run_after is None else run_after.get("output"),
                met=None if run_after is None else run_after.get("tolerance_met") is True,
                evaluated_late=late,
                met_before=None if run_before is None else run_before.get("tolerance_met") is True,
            )
        )
    main = state.main_load()
    activity, slos = None, []
    if main is not None and main.metrics_before is not None and main.metrics_after is not None:
        activity = EngineActivity.between(main.metrics_before, main.metrics_after, main.samples)
        slos = evaluate_all(run_spec(), main)
    storms = [storm.to_json() for storm in state.storms]
    unmeasured = _not_measured(storms, slos)
    if status == "held" and unmeasured:  # HELD on what was measured; what was not is named in the headline too
        reason += f"; not measured on this server: {unmeasured}"
    return Verdict(
        title=experiment.get("title", ""),
        status=status,
        reason=reason,
        checks=checks,
        load=main.result.summary if main is not None and main.result is not None else None,
        activity=activity,
        recovery_s=None if main is None else time_to_recover(main.samples, state.fault_windows),
        prefix_cache=None if main is None else prefix_cache_phases(main.samples, state.fault_windows),
        load_phases=None if main is None or main.result is None else load_phases(main.result, state.fault_windows),
        fault_windows=list(state.fault_windows),
        restarts_s=list(state.restarts),
        storms=storms,
        slos=slos,
        slo_profile=state.slo_profile
        if state.slo_file is None
        else f"{state.slo_profile}, thresholds from {state.slo_file}",
        arrival=main.result.config.arrival if main is not None and main.result is not None else None,
        target_size=state.target_size,
    )


def load_phases(result: RunResult, fault_windows: list[FaultWindow]) -> tuple[LoadPhase, LoadPhase, LoadPhase] | None:
    """The ok requests sent before the first fault, between it and the end of the last, and after; None without a
    fault."""
    if not fault_windows:
        return None
    first_start = min(w.start_unix for w in fault_windows)
    last_end = max(w.end_unix for w in fault_windows)
    phases: tuple[list, list, list] = ([], [], [])
    for record in result.records:
        if record.outcome is Outcome.OK:
            sent_unix = result.start_unix + record.sent_s
            phases[0 if sent_unix < first_start else 1 if sent_unix < last_end else 2].append(record)
    before, during, after = (
        LoadPhase(LatencyStats.of([r.ttft_s for r in records if r.ttft_s is not None]), prefix_reuse(records))
        for records in phases
    )
    return before, during, after


def _not_measured(storms: list[dict[str, Any]], slos: list[SloResult]) -> str:
    """What the run could not measure on this server, in words ("" when it measured everything)."""
    missing = [f"SLO {result.slo.name} ({result.why_unmeasured})" for result in slos if not result.exposed]
    if any(storm["aborts_counted"] == NOT_EXPORTED for storm in storms):
        missing.append("client aborts of the disconnect storms (the server counts none)")
    return ", ".join(missing)


def describe_tolerance(probe: Mapping[str, Any]) -> str:
    tolerance = probe.get("tolerance")
    unit = " s" if probe.get("provider", {}).get("func") in SECONDS_PROBES else ""
    if isinstance(tolerance, bool):
        return "true" if tolerance else "false"
    if isinstance(tolerance, int):
        return f"= {tolerance}"
    if isinstance(tolerance, dict) and tolerance.get("type") == "range":
        tolerance = tolerance["range"]
    if isinstance(tolerance, dict) and tolerance.get("type") == "regex":
        # "^(kept|no promise stated)": "kept or no promise stated"
        return " or ".join(tolerance["pattern"].strip("^$()").split("|"))
    if isinstance(tolerance, list) and len(tolerance) == 2:
        low, high = tolerance
        return f"<= {high:g}{unit}" if low == 0 else f"{low:g} to {high:g}{unit}"
    return str(tolerance)


def _runs_by_name(state: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    return {run["activity"]["name"]: run for run in (state or {}).get("probes", [])}


def judge(journal: Mapping[str, Any]) -> tuple[str, str]:
    """The status of a run and why, from its Chaos Toolkit journal alone (see ``STATUSES``).

    HELD needs positive evidence: the method ran, and every probe of the hypothesis was run and met before it and
    after it. Everything else is named as what it is, and a journal this does not recognise is ``unknown``, never
    HELD. A miss before the method is NOT RUN whatever status Chaos Toolkit gave it (chaostoolkit-lib records it as
    "completed", not deviated; ``chaos.controls`` marks it "failed")."""
    if journal.get("kvstorm_not_applicable"):
        return "not_applicable", journal["kvstorm_not_applicable"]
    before, after = journal["steady_states"].get("before"), journal["steady_states"].get("after")
    status = journal.get("status")
    if before is not None and not before.get("steady_state_met"):
        return "not_run", f"the baseline misses {_first_miss(before)}, nothing was injected"
    if status in ("aborted", "interrupted"):
        failed = next((r["activity"]["name"] for r in journal.get("run", []) if r.get("status") == "failed"), None)
        return status, f"the experiment was {status}" + (f": {failed} failed" if failed else "")
    if journal.get("deviated") or (after is not None and not after.get("steady_state_met")):
        return "deviated", f"the steady state did not hold after the method: {_first_miss(after)}"
    if status == "failed":
        return "failed", "Chaos Toolkit marked the run failed though no steady-state check it ran was missed"
    missing = _missing_evidence(journal, before, after)
    if status != "completed" or missing:
        status_note = f"Chaos Toolkit status {status!r}" if status != "completed" else ""
        why = "; ".join(part for part in (status_note, missing) if part)
        return "unknown", f"no evidence that the steady state held ({why})"
    return "held", "every steady-state check was met before and after the method"


def _missing_evidence(journal: Mapping[str, Any], before: Mapping | None, after: Mapping | None) -> str:
    """What is missing for HELD, or "" when nothing is: a method that ran, each probe met both before and after."""
    probes = [probe["name"] for probe in (journal["experiment"].get("steady-state-hypothesis") or {}).get("probes", [])]
    if not probes:
        return "the experiment has no steady-state probe"
    if not journal.get("run"):
        return "the method did not run"
    for run in journal["run"]:
        name, output = run["activity"]["name"], run.get("output")
        if run.get("status") != "succeeded":
            error = (run.get("exception") or ["no error recorded"])[-1].strip()
            return f"the method's {name} failed ({error.removeprefix('chaoslib.exceptions.ActivityFailed: ')})"
        # A load none of whose requests was served (a wrong model name: every request a 404) proves nothing held; a
        # load that is itself the fault (a flood) may be refused whole by a server that defends itself.
        provider = run["activity"].get("provider", {})
        is_load = provider.get("func") == "run_load" and not provider.get("arguments", {}).get("as_fault")
        if is_load and isinstance(output, Mapping):
            outcomes = output.get("outcomes") or {}
            if not outcomes.get("ok"):
                return f"no request of the method's {name} was served ({_outcome_counts(outcomes)})"
    for when, state in (("before", before), ("after", after)):
        runs = _runs_by_name(state)
        unmet = [name for name in probes if name not in runs or runs[name].get("tolerance_met") is not True]
        if state is None or not state.get("steady_state_met") or unmet:
            return f"not every check was met {when} the method: {', '.join(unmet) or 'no hypothesis recorded'}"
    return ""


def _outcome_counts(outcomes: Mapping[str, Any]) -> str:
    return ", ".join(f"{count} {outcome}" for outcome, count in outcomes.items()) or "none sent"


def _first_miss(state: Mapping[str, Any] | None) -> str:
    """The first probe of a hypothesis that missed, with its value against its tolerance."""
    for run in (state or {}).get("probes", []):
        if run.get("tolerance_met"):
            continue
        activity = run["activity"]
        if run.get("status") != "succeeded":
            error = (run.get("exception") or ["no error recorded"])[-1].strip()
            return f"{activity['name']} (the probe failed: {error})"
        return f"{activity['name']} ({_against(activity, run.get('output'))})"
    return "a check the journal does not name"


def _against(probe: Mapping[str, Any], value: Any) -> str:
    """``value`` against the tolerance it missed: "0.367 s > 1e-06", "false, expected true", "3, expected 0"."""
    unit = " s" if probe.get("provider", {}).get("func") in SECONDS_PROBES else ""
    tolerance = probe.get("tolerance")
    if isinstance(tolerance, dict) and tolerance.get("type") == "range":
        tolerance = tolerance["range"]
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(tolerance, list) and len(tolerance) == 2 and is_number:
        low, high = tolerance
        if value > high:
            return f"{value:g}{unit} > {high:g}"
        if value < low:
            return f"{value:g}{unit} < {low:g}"
    shown = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{shown}{unit if is_number else ''}, expected {describe_tolerance(probe)}"


def _evaluate(probe: Mapping[str, Any], configuration: Mapping[str, Any]) -> dict[str, Any]:
    try:
        output = run_activity(dict(probe), dict(configuration), {})
    except Exception as error:
        return {"output": f"failed: {error}", "tolerance_met": False}
    met = within_tolerance(probe["tolerance"], output, configuration=dict(configuration), secrets={})
    return {"output": output, "tolerance_met": met}
