"""The ``kvstorm`` command: one entry point, one subcommand per job.

The dispatcher owns every subcommand (``engine_commands``, ``chaos_commands``, ``bench/``): the packages it drives
(engine, loadgen, chaos) know nothing of the command line, and this package is the only one that imports them all.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from collections.abc import Sequence

from kernels.cpu_isa import CeilingError, apply_cpu_isa_ceiling
from kvstorm.bench.doc import update_section

# Each command's module, imported only when that command runs (all of them for --help or an unknown command):
# torch, transformers and the engine take seconds to import, and the harness's commands (chaos, bench serve) and
# the chaos controller's runs never use them.
COMMANDS = {
    "demo": ("kvstorm.chaos_commands", "add_demo_parser"),
    "generate": ("kvstorm.engine_commands", "add_generate_parser"),
    "serve": ("kvstorm.engine_commands", "add_serve_parser"),
    "chaos": ("kvstorm.chaos_commands", "add_chaos_parser"),
    "dashboards": ("kvstorm.dashboards_commands", "add_dashboards_parser"),
    "simulate": ("kvstorm.simulate.command", "add_simulate_parser"),
}
# ``kvstorm bench NAME``: module, its parser, its run (which returns a BenchReport, or one per case in a list).
BENCHMARKS = {
    "offline": ("kvstorm.bench.offline", "add_bench_offline_parser", "run_bench_offline"),
    "serve": ("kvstorm.bench.serve", "add_bench_serve_parser", "run_bench_serve"),
    "preemption-modes": (
        "kvstorm.bench.preemption_modes",
        "add_bench_preemption_modes_parser",
        "run_bench_preemption_modes",
    ),
    "client-capacity": ("kvstorm.bench.serve", "add_bench_client_capacity_parser", "run_bench_client_capacity"),
    "goodput": ("kvstorm.bench.goodput", "add_bench_goodput_parser", "run_bench_goodput"),
    "neighbours": ("kvstorm.bench.neighbours", "add_bench_neighbours_parser", "run_bench_neighbours"),
    "prefix-caching": (
        "kvstorm.bench.prefix_caching",
        "add_bench_prefix_caching_parser",
        "run_bench_prefix_caching",
    ),
    "traces": ("kvstorm.bench.traces", "add_bench_traces_parser", "run_bench_traces"),
    "cpu-speed": ("kvstorm.bench.cpu_speed", "add_bench_cpu_speed_parser", "run_bench_cpu_speed"),
    "co-tenant": ("kvstorm.bench.co_tenant", "add_bench_co_tenant_parser", "run_bench_co_tenant"),
    "prefill-cap": ("kvstorm.bench.prefill_cap", "add_bench_prefill_cap_parser", "run_bench_prefill_cap"),
    "simulator": ("kvstorm.bench.simulator", "add_bench_simulator_parser", "run_bench_simulator"),
    "what-if": ("kvstorm.bench.what_if", "add_bench_what_if_parser", "run_bench_what_if"),
    "soak": ("kvstorm.bench.soak", "add_bench_soak_parser", "run_bench_soak"),
    "simulator-speed": (
        "kvstorm.bench.simulator_speed",
        "add_bench_simulator_speed_parser",
        "run_bench_simulator_speed",
    ),
    "kernels-aot": ("kvstorm.bench.kernels_aot", "add_bench_kernels_aot_parser", "run_bench_kernels_aot"),
    # Micro-benchmarks of the engine's parts, and of what serving costs it.
    "attention": ("kvstorm.bench.attention", "add_bench_attention_parser", "run_bench_attention"),
    "layer-ops": ("kvstorm.bench.layer_ops", "add_bench_layer_ops_parser", "run_bench_layer_ops"),
    "linear": ("kvstorm.bench.linear", "add_bench_linear_parser", "run_bench_linear"),
    "compile": ("kvstorm.bench.compile", "add_bench_compile_parser", "run_bench_compile"),
    "generate": ("kvstorm.bench.generate", "add_bench_generate_parser", "run_bench_generate"),
    "serving-overhead": (
        "kvstorm.bench.serving_overhead",
        "add_bench_serving_overhead_parser",
        "run_bench_serving_overhead",
    ),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ARGV that names a command (and a benchmark), only that command's branch."""
    words = [arg for arg in argv or () if not arg.startswith("-")]
    command = words[0] if words and words[0] in [*COMMANDS, "bench"] else None
    benchmark = words[1] if command == "bench" and len(words) > 1 and words[1] in BENCHMARKS else None
    parser = argparse.ArgumentParser(prog="kvstorm", description="continuous-batching LLM engine and chaos harness")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module, add_parser) in COMMANDS.items():
        if command in (None, name):
            getattr(importlib.import_module(module), add_parser)(subparsers)
    if command not in (None, "bench"):
        return parser
    bench = subparsers.add_parser("bench", help="benchmarks that print numbers and record them in docs/benchmarks.md")
    bench.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    bench_subparsers = bench.add_subparsers(dest="bench", required=True)
    for name, (module_name, add_parser, run) in BENCHMARKS.items():
        if benchmark in (None, name):
            module = importlib.import_module(module_name)
            getattr(module, add_parser)(bench_subparsers)
            bench_subparsers.choices[name].set_defaults(handler=_bench_handler(getattr(module, run), name))
    return parser


def _bench_handler(run, section: str):
    """Run a benchmark, print its report, and record it in docs/benchmarks.md with the command line."""

    def handler(args: argparse.Namespace) -> int:
        returned = run(args)
        command = reproducible_command(sys.argv[1:])
        failed = False
        for report in returned if isinstance(returned, list) else [returned]:  # a list: one report per case
            title = f"`kvstorm bench {section}`" + ("" if report.case is None else f" ({report.case})")
            markdown = f"## {title}\n\n{report.markdown}\n\nReproduce: `{command}` ({time.strftime('%Y-%m-%d')})"
            print(markdown)
            if report.failures:
                print(f"kvstorm bench {section}: failed: {', '.join(report.failures)}", file=sys.stderr)
                failed = True
            elif not args.no_docs:
                update_section(f"bench-{section}" + ("" if report.case is None else f"-{report.case}"), markdown)
        return 1 if failed else 0

    return handler


# Where a run wrote its raw results: a path on this machine, not part of what reproduces the numbers.
OUTPUT_FLAGS = ("--json", "--results-dir")


def reproducible_command(argv: list[str]) -> str:
    """The command line to paste into a shell: quoted where an argument needs it (``--server-args "--dtype ..."``)."""
    return shlex.join(["kvstorm", *reproducible_args(argv)])


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
    argv = sys.argv[1:] if argv is None else argv
    try:
        # Before any command imports torch: oneDNN, ATen and MKL read their caps once, when first used.
        apply_cpu_isa_ceiling()
    except CeilingError as error:
        print(f"kvstorm: error: {error}", file=sys.stderr)
        return 2
    args = build_parser(argv).parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvstorm {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
