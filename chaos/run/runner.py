"""``kvstorm chaos run``: a Chaos Toolkit experiment file run through chaostoolkit-lib (the same engine as the
stock ``chaos run``), with a live progress line, a verdict table, and a results folder:

    chaos-results/<experiment>-<time>/
        journal.json     Chaos Toolkit's journal (what ``chaos run --journal-path`` writes)
        verdict.md       the verdict tables
        report.html      the load's report with every fault window as a band, the verdict on top
        dashboards.html  with --prometheus-url: the SLO and engine dashboards over the run (kvstorm dashboards render)
        load.json        the load generator's results (every request record)
        chaostoolkit.log

Rollbacks run whatever happens (strategy ``always``, also on Ctrl-C); the faults set through ``chaos.actions``
carry a lease besides, so an engine clears them even if this process dies.
"""

from __future__ import annotations

import html
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from chaoslib.configuration import load_configuration
from chaoslib.control import load_global_controls
from chaoslib.experiment import run_experiment
from chaoslib.loader import load_experiment
from rich.console import Console

from chaos.judgement.slo_check import run_spec
from chaos.judgement.verdict import Verdict, build_verdict
from chaos.judgement.verdict_view import print_verdict, to_html, to_markdown
from chaos.run.progress import LiveLine
from chaos.run.state import RunState, reset
from dashboards.build import boards
from dashboards.render import render
from dashboards.rules import recordings
from dashboards.slo import load_spec
from loadgen.report import write_report
from loadgen.results import RunResult, replacing, write_text_atomic

EXPERIMENTS_DIR = Path(__file__).resolve().parent.parent / "experiments"
REPORT_BOARDS = ("kvstorm-slo", "kvstorm-engine")
# An experiment's load sends a request or two a second: percentiles per 5 s say more than per 1 s.
REPORT_BUCKET_S = 5.0
SETTINGS = {
    "runtime": {"rollbacks": {"strategy": "always"}},
    "controls": {
        "kvstorm-progress": {"provider": {"type": "python", "module": "chaos.run.progress"}},
        "kvstorm-stop-loads": {"provider": {"type": "python", "module": "chaos.run.stop_loads"}},
    },
}


@dataclass(frozen=True)
class ExperimentRun:
    verdict: Verdict
    journal: dict[str, Any]
    results_dir: Path
    # The experiment's main load, every request record of it.
    load: RunResult | None

    @property
    def report_path(self) -> Path:
        return self.results_dir / "report.html"


def resolve_experiment(name_or_path: str) -> Path:
    """A path, or the name of an experiment of the library (``chaos/experiments/<name>.yaml``)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    library = EXPERIMENTS_DIR / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if library.exists():
        return library
    names = ", ".join(sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")))
    raise FileNotFoundError(f"no experiment {name_or_path!r}: not a file, and the library has {names}")


def run_experiment_file(
    path: Path,
    variables: Mapping[str, Any],
    results_root: Path,
    console: Console | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    slo_profile: str | None = None,
    slo_file: Path | None = None,
    prometheus_url: str | None = None,
) -> ExperimentRun:
    """Run one experiment with its configuration overridden by ``variables`` (``target_url``, ``model``, ...).
    ``on_event`` hears the run as it happens (``RunState.emit``), its verdict last. ``slo_profile`` and
    ``slo_file``: the SLO spec it is judged by (default: the environment's, else the cpu profile).
    ``prometheus_url``: a Prometheus that scrapes the target; the SLO and engine dashboards over the run are drawn
    from it next to the report."""
    console = console or Console(stderr=True)
    experiment = load_experiment(str(path))
    state = reset()
    state.slo_profile = slo_profile or state.slo_profile
    state.slo_file = slo_file or state.slo_file
    run_spec()  # a bad profile or overrides file fails here, before anything runs
    if on_event is not None:
        state.listeners.append(on_event)
    results_dir = results_root / f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    results_dir.mkdir(parents=True, exist_ok=True)
    configuration = load_configuration(experiment.get("configuration", {}), dict(variables))
    load_global_controls(SETTINGS)
    log_handler = _log_to(results_dir / "chaostoolkit.log")
    try:
        with LiveLine(configuration.get("target_url", ""), console) as line:
            journal = run_experiment(
                experiment, settings=SETTINGS, experiment_vars=(dict(variables), {}), event_handlers=[line]
            )
    finally:
        logging.getLogger("chaostoolkit").removeHandler(log_handler)
        for proxy in state.proxies.values():
            proxy.stop()
        for keeper in state.lease_keepers.values():
            keeper.stop()
    verdict = build_verdict(journal, state, configuration)
    main = state.main_load()
    write_error = _write_results(verdict, journal, state, results_dir, prometheus_url, console)
    print_verdict(verdict, console)
    state.emit(
        "verdict",
        status=verdict.status,
        reason=verdict.reason,
        exit_code=verdict.exit_code,
        results_dir=str(results_dir),
        fault_windows=[window.model_dump() for window in verdict.fault_windows],
        # kill-and-restart's: seconds from each restart to ready, for the controller's callers to read.
        restarts_s=verdict.restarts_s,
        # None when every file was written; else what failed, so a follower hears the verdict and why a file is missing.
        write_error=write_error,
    )
    return ExperimentRun(verdict, journal, results_dir, None if main is None else main.result)


def _write_results(
    verdict: Verdict,
    journal: dict[str, Any],
    state: RunState,
    results_dir: Path,
    prometheus_url: str | None,
    console: Console,
) -> str | None:
    """The run's files, each written atomically (a reader sees a whole file or none); a file that cannot be written
    costs the verdict nothing: the error is returned for the verdict event instead of raised past it."""
    try:
        write_text_atomic(results_dir / "journal.json", json.dumps(journal, indent=1, default=str))
        write_text_atomic(results_dir / "verdict.md", to_markdown(verdict) + "\n")
        main = state.main_load()
        load = None if main is None else main.result
        dashboards = ""
        if load is not None:
            load.fault_windows = list(state.fault_windows)
            load.write(results_dir / "load.json")
            if prometheus_url is not None:
                dashboards = _render_dashboards(prometheus_url, state, results_dir, console)
        with replacing(results_dir / "report.html") as report:  # also for a run whose load never ran: its verdict
            write_report(
                load,
                report,
                bucket_s=REPORT_BUCKET_S,
                title=f"kvstorm chaos run: {verdict.title}",
                heading_html=to_html(verdict) + dashboards,
            )
    except OSError as error:
        why = f"results not written in {results_dir}: {type(error).__name__}: {error}"
        console.print(why, style="red", markup=False)
        return why
    return None


def _render_dashboards(prometheus_url: str, state: RunState, results_dir: Path, console: Console) -> str:
    """Draw the SLO and engine dashboards from a minute before the run to now into ``dashboards.html``; the
    report's link to it, or why there is none (a Prometheus that cannot answer costs the run nothing else)."""
    slos = load_spec(state.slo_profile, state.slo_file)
    shown = [board for board in boards(slos) if board.uid in REPORT_BOARDS]
    try:
        page = render(shown, prometheus_url, state.started_unix - 60, time.time(), recordings(slos))
    except (requests.RequestException, ValueError) as error:
        why = f"no dashboards: Prometheus at {prometheus_url} did not answer ({error})"
        console.print(why, style="yellow", markup=False)
        return f"<p>{html.escape(why)}</p>"
    write_text_atomic(results_dir / "dashboards.html", page)
    return (
        "<p><a href='dashboards.html'>The SLO and engine dashboards over this run</a> "
        f"(from Prometheus at {html.escape(prometheus_url)}; the panels of Grafana's kvstorm dashboards).</p>"
    )


def _log_to(path: Path) -> logging.Handler:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("chaostoolkit")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # the log file, not the terminal under the progress line
    return handler
