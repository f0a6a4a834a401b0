"""The ``kvstorm`` command: one entry point, one subcommand per job.

The dispatcher owns every subcommand (``engine_commands``, ``chaos_commands``, ``bench/``): the packages it drives
(engine, loadgen, chaos) know nothing of the command line, and this package is the only one that imports them all.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvstorm.bench.doc import update_section
from kvstorm.bench.goodput import add_bench_goodput_parser, run_bench_goodput
from kvstorm.bench.kernels_aot import add_bench_kernels_aot_parser, run_bench_kernels_aot
from kvstorm.bench.offline import add_bench_offline_parser, run_bench_offline
from kvstorm.bench.preemption_modes import add_bench_preemption_modes_parser, run_bench_preemption_modes
from kvstorm.bench.serve import (
    add_bench_client_capacity_parser,
    add_bench_serve_parser,
    run_bench_client_capacity,
    run_bench_serve,
)
from kvstorm.chaos_commands import add_chaos_parser, add_demo_parser
from kvstorm.dashboards_commands import add_dashboards_parser
from kvstorm.engine_commands import add_generate_parser, add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstorm", description="continuous-batching LLM engine and chaos harness")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(subparsers)
    add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_chaos_parser(subparsers)
    add_dashboards_parser(subparsers)
    bench = subparsers.add_parser("bench", help="benchmarks that print numbers and record them in docs/benchmarks.md")
    bench.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    bench_subparsers = bench.add_subparsers(dest="bench", required=True)
    add_bench_offline_parser(bench_subparsers)
    bench_subparsers.choices["offline"].set_defaults(handler=_bench_handler(run_bench_offline, "offline"))
    add_bench_serve_parser(bench_subparsers)
    bench_subparsers.choices["serve"].set_defaults(handler=_bench_handler(run_bench_serve, "serve"))
    add_bench_preemption_modes_parser(bench_subparsers)
    bench_subparsers.choices["preemption-modes"].set_defaults(
        handler=_bench_handler(run_bench_preemption_modes, "preemption-modes")
    )
    add_bench_client_capacity_parser(bench_subparsers)
    bench_subparsers.choices["client-capacity"].set_defaults(
        handler=_bench_handler(run_bench_client_capacity, "client-capacity")
    )
    add_bench_goodput_parser(bench_subparsers)
    bench_subparsers.choices["goodput"].set_defaults(handler=_bench_handler(run_bench_goodput, "goodput"))
    add_bench_kernels_aot_parser(bench_subparsers)
    bench_subparsers.choices["kernels-aot"].set_defaults(handler=_bench_handler(run_bench_kernels_aot, "kernels-aot"))
    return parser


def _bench_handler(run, section: str):
    """Run a benchmark, print its report, and record it in docs/benchmarks.md with the command line."""

    def handler(args: argparse.Namespace) -> int:
        report = run(args)
        command = " ".join(["kvstorm", *reproducible_args(sys.argv[1:])])
        markdown = (
            f"## `kvstorm bench {section}`\n\n{report.markdown}\n\nReproduce: `{command}` ({time.strftime('%Y-%m-%d')})"
        )
        print(markdown)
        if report.failures:
            print(f"kvstorm bench {section}: failed: {', '.join(report.failures)}", file=sys.stderr)
            return 1
        if not args.no_docs:
            update_section(f"bench-{section}", markdown)
        return 0

    return handler


# Where a run wrote its raw results: a path on this machine, not part of what reproduces the numbers.
OUTPUT_FLAGS = ("--json", "--results-dir")


def reproducible_args(argv: list[str]) -> list[str]:
    """The command line without the flags that say where this run wrote its raw results (``OUTPUT_FLAGS``)."""
    kept: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg in OUTPUT_FLAGS:
            skip_next = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in OUTPUT_FLAGS)):
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvstorm {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
