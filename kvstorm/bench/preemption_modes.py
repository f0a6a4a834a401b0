"""``kvstorm bench preemption-modes``: one chaos experiment against kvstorm in recompute, swap and auto mode, on
identical load, in one table: a ``kvstorm chaos compare`` of one started kvstorm per mode
(``chaos.judgement.compare``)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from chaos.judgement.compare import Target, compare, comparison_markdown
from chaos.run.runner import resolve_experiment
from kvstorm.bench.doc import BenchReport

MODES = ("recompute", "swap", "auto")
DEFAULT_EXPERIMENT = "swap-pressure-slow-host-link"
DEFAULT_SERVER_ARGS = "--num-kv-blocks 88 --swap-space 256MiB"


def add_bench_preemption_modes_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "preemption-modes",
        help="one chaos experiment in recompute, swap and auto preemption mode, identical load, one table",
    )
    parser.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="a file or a library name")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in this order")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="the rest of each kvstorm serve command")
    parser.add_argument("--results-dir", type=Path, default=Path("chaos-results"))


def mode_targets(modes: str, server_args: str) -> list[Target]:
    """One started kvstorm per mode, named after it: ``server_args`` and ``--preemption-mode MODE``."""
    targets = []
    for mode in modes.split(","):
        if mode not in MODES:
            raise ValueError(f"preemption modes are {MODES}, got {mode!r}")
        targets.append(Target(mode, server_args=(*shlex.split(server_args), "--preemption-mode", mode)))
    return targets


def run_bench_preemption_modes(args: argparse.Namespace) -> BenchReport:
    experiment = resolve_experiment(args.experiment)
    comparison = compare(
        experiment, mode_targets(args.modes, args.server_args), {"model": "smollm2-135m"}, args.results_dir
    )
    markdown = (
        f"Experiment `{experiment.stem}` against `kvstorm serve {args.server_args} --preemption-mode MODE`, "
        "one fresh server per mode, back to back, the same seed (identical arrivals, prompts and lengths). "
        "Goodput: ok requests per second whose own latencies met every latency SLO of the experiment.\n\n"
        + comparison_markdown(comparison.runs)
    )
    print(f"report: {comparison.results_dir / 'report.html'}")
    failures = [run.target.name for run in comparison.runs if run.run.verdict.exit_code == 2]
    return BenchReport(markdown, failures=failures)
