"""``kvstorm bench preemption-modes``: one chaos experiment against kvstorm in recompute, swap and auto mode, on
identical load, in one table (``chaos.compare``)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from chaos.compare import MODES, compare_preemption_modes, comparison_markdown
from chaos.runner import resolve_experiment
from kvstorm.bench.doc import BenchReport

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


def run_bench_preemption_modes(args: argparse.Namespace) -> BenchReport:
    experiment = resolve_experiment(args.experiment)
    runs = compare_preemption_modes(experiment, args.modes.split(","), shlex.split(args.server_args), args.results_dir)
    markdown = (
        f"Experiment `{experiment.stem}` against `kvstorm serve {args.server_args} --preemption-mode MODE`, "
        "one fresh server per mode, back to back, the same seed (identical arrivals, prompts and lengths). "
        "Goodput: ok requests per second whose own latencies met every latency SLO of the experiment.\n\n"
        + comparison_markdown(runs)
    )
    for run in runs:
        print(f"{run.mode}: {run.run.results_dir / 'report.html'}")
    failures = [run.mode for run in runs if run.run.verdict.exit_code == 2]
    return BenchReport(markdown, failures=failures)
