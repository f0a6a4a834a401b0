"""One experiment against several targets, back to back on identical load, judged side by side.

A target is a server someone else runs (``NAME=URL``: kvstorm, vLLM, SGLang, TGI) or a configuration of kvstorm
started here (``NAME=kvstorm serve ARGS``: a fresh server on a free loopback port, run, stopped). Each target gets
the same experiment with the same configuration (so the same seed: the same arrivals, prompts and lengths), one
after the other, each with its own results folder as ``kvstorm chaos run`` writes it. Then one comparison:

    chaos-results/compare-<experiment>-<time>/
        compare.md        the side-by-side table (every check, outcomes, latency, preemption, recovery, goodput)
        report.html       that table, each target's verdict, and every target's timeline stacked on one time axis
        <target>/         the target's own run folder (journal, verdict, report), and server.log when started here
"""

from __future__ import annotations

import html
import os
import secrets
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.markup import escape

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from chaos.injectors.processes import kvstorm_server
from chaos.judgement.verdict_view import (
    STATUS_WORDS,
    Section,
    describe_preemptions,
    describe_size,
    describe_swapped,
    format_value,
    headline,
    rich_tables,
    sections_html,
    sections_markdown,
    shown_if_exported,
)
from chaos.run.runner import REPORT_BUCKET_S, ExperimentRun, run_experiment_file
from loadgen.analysis import LatencyStats, Slo, summarize
from loadgen.records import Outcome
from loadgen.report import write_stacked_report
from loadgen.results import replacing, write_text_atomic

# Options of ``kvstorm serve`` a started target may not set: the comparison picks its address.
RESERVED_SERVER_OPTIONS = ("--port", "--host")


@dataclass(frozen=True)
class Target:
    """``url``: a running server's base URL; None for a kvstorm this starts with ``server_args`` (``kvstorm serve``'s
    options, without the port)."""

    name: str
    url: str | None = None
    server_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"target name {self.name!r}: letters, digits, '-' and '_' only (it names a folder)")
        reserved = [arg for arg in self.server_args if arg.split("=")[0] in RESERVED_SERVER_OPTIONS]
        if reserved:
            raise ValueError(f"target {self.name}: {', '.join(reserved)} is chosen by the comparison, not the target")

    def describe(self) -> str:
        return self.url if self.url is not None else shlex.join(["kvstorm", "serve", *self.server_args])


@dataclass(frozen=True)
class TargetRun:
    target: Target
    run: ExperimentRun
    # Ok requests per second whose own latencies met every latency SLO the experiment states (None: no load, or no
    # latency SLO).
    goodput: float | None


@dataclass(frozen=True)
class Comparison:
    runs: list[TargetRun]
    results_dir: Path

    @property
    def exit_code(self) -> int:
        """The worst of the runs': 0 when every target held, 1 when one missed a check, 2 when a run failed."""
        return max(run.run.verdict.exit_code for run in self.runs)


def parse_target(spec: str) -> Target:
    """``NAME=URL``: a server someone else runs."""
    name, url = _split(spec, "--target", "NAME=URL")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--target {spec!r}: the URL must start with http:// or https://")
    return Target(name, url=url.rstrip("/"))


def parse_server(spec: str) -> Target:
    """``NAME=ARGS``, ARGS ``kvstorm serve``'s options, with or without a leading ``kvstorm serve``."""
    name, command = _split(spec, "--server", "NAME='kvstorm serve ARGS'")
    args = shlex.split(command)
    if args[:2] == ["kvstorm", "serve"]:
        args = args[2:]
    return Target(name, server_args=tuple(args))


def _split(spec: str, option: str, form: str) -> tuple[str, str]:
    name, sep, value = spec.partition("=")
    if not sep or not name or not value.strip():
        raise ValueError(f"{option} {spec!r}: expected {form}")
    return name, value.strip()


def compare(
    experiment: Path,
    targets: Sequence[Target],
    variables: Mapping[str, Any],
    results_root: Path,
    console: Console | None = None,
    **run_options: Any,
) -> Comparison:
    """Run ``experiment`` against each target in turn (``variables``: its configuration, ``target_url`` set per
    target; ``run_options``: ``run_experiment_file``'s SLO options), then write and print the comparison."""
    console = console or Console(stderr=True)
    names = [target.name for target in targets]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"a comparison needs targets with distinct names, got {names}")
    results_dir = results_root / f"compare-{experiment.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = []
    for target in targets:
        console.print(f"[bold]{target.name}[/]: {escape(target.describe())}", highlight=False)
        run = run_target(experiment, target, variables, results_dir / target.name, console, **run_options)
        runs.append(TargetRun(target, run, goodput(run)))
    comparison = Comparison(runs, results_dir)
    write_comparison(comparison, experiment.stem)
    console.print(Group(*rich_tables([side_by_side(runs)])))
    for target_run in runs:
        console.print(f"{target_run.target.name}: {headline(target_run.run.verdict)}", markup=False)
    return comparison


def run_target(
    experiment: Path,
    target: Target,
    variables: Mapping[str, Any],
    results_root: Path,
    console: Console,
    **run_options: Any,
) -> ExperimentRun:
    """The experiment against one target; a kvstorm started for it is stopped whatever happens. A started server
    gets ``$KVSTORM_ADMIN_TOKEN`` (a random one when unset), the token the experiment's engine faults send."""
    if target.url is not None:
        return run_experiment_file(
            experiment, {**variables, "target_url": target.url}, results_root, console, **run_options
        )
    os.environ.setdefault(ADMIN_TOKEN_ENV, secrets.token_urlsafe(16))
    with kvstorm_server(target.server_args, results_root / "server.log") as kvstorm:
        console.print(f"{target.name}: ready on {kvstorm.url}", highlight=False)
        return run_experiment_file(
            experiment, {**variables, "target_url": kvstorm.url}, results_root, console, **run_options
        )


def goodput(run: ExperimentRun) -> float | None:
    """Ok requests per second whose own latencies met every latency SLO the experiment states."""
    hypothesis = run.journal["experiment"].get("steady-state-hypothesis") or {}
    slos = [
        Slo(metric=args["metric"], stat=args["stat"], threshold_s=float(probe["tolerance"]["range"][1]))
        for probe in hypothesis.get("probes", [])
        if probe["provider"].get("func") == "load_latency"
        for args in [probe["provider"]["arguments"]]
    ]
    if run.load is None or not slos:
        return None
    return summarize(run.load.records, run.load.summary.duration_s, slos).goodput


def side_by_side(runs: Sequence[TargetRun]) -> Section:
    """One column per target: its status, every check of the experiment (the value after the method, and whether
    it was met), what its clients saw, what the server did, recovery and goodput. A check row is red when a target
    missed it, green when every target met it."""
    rows: list[tuple[str, ...]] = [("verdict", *(STATUS_WORDS[run.run.verdict.status] for run in runs))]
    marks: list[bool | None] = [None]
    for name, expectation in _check_names(runs):
        cells, met = zip(*(_check_cell(run, name) for run in runs), strict=True)
        rows.append((f"{name} ({expectation})", *cells))
        marks.append(False if False in met else True if all(met) else None)
    sized = any(run.run.verdict.target_size is not None for run in runs)
    arrivals = {_arrival(run) for run in runs}
    # An unsized load sent alike to every target is said once, in the title; a sized one per target, in a row.
    arrival_in_title = not sized and len(arrivals) == 1
    for label, value in _FIGURES:
        cells = tuple(value(run) for run in runs)
        # A figure no target has (no sizing, no latency check) says nothing.
        if any(cell != "-" for cell in cells) and not (value is _arrival and arrival_in_title):
            rows.append((label, *cells))
            marks.append(None)
    if sized:
        title = (
            "Side by side (each target: the same experiment and seed; the load is sized from each server, as the "
            "arrival row shows)"
        )
    else:
        sent = f": {next(iter(arrivals))}" if arrival_in_title and "-" not in arrivals else ""
        title = f"Side by side (each target: the same experiment, the same seeded load{sent})"
    return Section(title, ("", *_names(runs)), rows, marks)


def _arrival(run: TargetRun) -> str:
    return run.run.verdict.arrival or "-"


def _names(runs: Sequence[TargetRun]) -> list[str]:
    return [run.target.name for run in runs]


def _check_names(runs: Sequence[TargetRun]) -> list[tuple[str, str]]:
    """Every check any run has, in the order of the first run that has it."""
    seen: dict[str, str] = {}
    for run in runs:
        for check in run.run.verdict.checks:
            seen.setdefault(check.name, check.expectation)
    return list(seen.items())


def _check_cell(run: TargetRun, name: str) -> tuple[str, bool | None]:
    check = next((check for check in run.run.verdict.checks if check.name == name), None)
    if check is None:
        return "-", None
    if check.met_before is False:
        return f"{format_value(check.before)} FAIL before", False
    if check.met is None:
        return "not run", None
    return f"{format_value(check.after)} {'pass' if check.met else 'FAIL'}", check.met


def _outcomes(run: TargetRun) -> str:
    load = run.run.verdict.load
    if load is None:
        return "-"
    counts = load.outcomes
    return " / ".join(
        str(counts[outcome])
        for outcome in (Outcome.OK, Outcome.BROKEN_STREAM, Outcome.CLIENT_TIMEOUT, Outcome.REJECTED)
    )


def _latency(metric: str, scale: float) -> Any:
    def cell(run: TargetRun) -> str:
        load = run.run.verdict.load
        stats: LatencyStats | None = None if load is None else getattr(load, metric)
        return "-" if stats is None else f"{stats.p50 * scale:.2f} / {stats.p99 * scale:.2f}"

    return cell


def _activity_cell(describe: Any) -> Any:
    def cell(run: TargetRun) -> str:
        activity = run.run.verdict.activity
        return "-" if activity is None else describe(activity)

    return cell


def _recovery(run: TargetRun) -> str:
    verdict = run.run.verdict
    if not verdict.fault_windows:
        return "no fault"
    return "not within the load" if verdict.recovery_s is None else f"{verdict.recovery_s:.1f} s"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# The rows after the checks: a label and what a run shows in it.
_FIGURES = (
    ("arrival (as sent)", _arrival),
    (
        "sized from",
        lambda run: "-" if run.run.verdict.target_size is None else describe_size(run.run.verdict.target_size),
    ),
    ("requests ok / broken / timed out / rejected", _outcomes),
    ("TTFT p50 / p99 s", _latency("ttft", 1.0)),
    ("ITL p50 / p99 ms", _latency("itl", 1e3)),
    ("TPOT p50 / p99 ms", _latency("tpot", 1e3)),
    ("E2E p50 / p99 s", _latency("e2e", 1.0)),
    ("preemptions", _activity_cell(describe_preemptions)),
    ("KV blocks swapped out / in", _activity_cell(describe_swapped)),
    ("tokens recomputed", _activity_cell(lambda a: shown_if_exported(a.recomputed_tokens))),
    ("time to recover", _recovery),
    ("goodput req/s (ok, within the latency checks)", lambda run: _number(run.goodput)),
)


def comparison_markdown(runs: Sequence[TargetRun]) -> str:
    targets = "\n".join(f"- `{run.target.name}`: `{run.target.describe()}`" for run in runs)
    verdicts = "\n".join(f"- `{run.target.name}`: {headline(run.run.verdict)}" for run in runs)
    return f"{targets}\n\n{sections_markdown([side_by_side(runs)])}\n\n{verdicts}"


def write_comparison(comparison: Comparison, experiment_name: str) -> None:
    """``compare.md`` and ``report.html`` (each verdict linked to its run's report, the table, the stacked
    timelines) in the comparison's folder, each written whole or not at all."""
    runs, folder = comparison.runs, comparison.results_dir
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / "compare.md", comparison_markdown(runs) + "\n")
    verdicts = "".join(_verdict_item(run, folder) for run in runs)
    with replacing(folder / "report.html") as report:
        write_stacked_report(
            [(run.target.name, run.run.load) for run in runs],
            report,
            bucket_s=REPORT_BUCKET_S,
            title=f"kvstorm chaos compare: {experiment_name}",
            heading_html=f"<ul>{verdicts}</ul>{sections_html([side_by_side(runs)])}",
        )


def _verdict_item(run: TargetRun, folder: Path) -> str:
    link = Path(os.path.relpath(run.run.report_path, folder)).as_posix()
    return (
        f"<li class='{'met' if run.run.verdict.held else 'missed'}'><b>{html.escape(run.target.name)}</b> "
        f"(<code>{html.escape(run.target.describe())}</code>): {html.escape(headline(run.run.verdict))} "
        f"<a href='{html.escape(link)}'>its report</a></li>"
    )
