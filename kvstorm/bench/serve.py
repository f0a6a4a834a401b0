"""``kvstorm bench serve`` (the load generator against any OpenAI-compatible server) and ``client-capacity``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from kernels.cpu_isa import cpu_kind
from kvstorm.bench.doc import BenchReport
from loadgen.arrivals import __doc__ as ARRIVALS_DOC
from loadgen.benchmark import run_benchmark, summary_markdown
from loadgen.capacity import CapacityRow, Placement, measure_capacity
from loadgen.capacity import __doc__ as CAPACITY_DOC
from loadgen.plan import MAX_PLAN_TOKENS, plan_size
from loadgen.records import Outcome
from loadgen.report import write_report
from loadgen.results import MAX_RETRIES, MAX_WORKERS, RunConfig, read_fault_windows
from loadgen.runner import RunCutShort, run_event_loop
from loadgen.spec import parse_duration
from loadgen.workloads import __doc__ as WORKLOADS_DOC


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _worker_count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"not a number of worker processes from 1 to {MAX_WORKERS}: {text!r}")
    return int(text)


def _worker_counts(text: str) -> list[int]:
    return [_worker_count(count) for count in text.split(",")]


def add_bench_serve_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "serve",
        help="open-loop streaming benchmark of any OpenAI-compatible server",
        description="Open-loop streaming benchmark: requests leave on schedule whatever earlier requests do.\n"
        + ARRIVALS_DOC.split("\n\n", 2)[2]
        + WORKLOADS_DOC.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (routes /v1/...)")
    parser.add_argument("--model", required=True, help="the model name the server expects")
    parser.add_argument(
        "--workload",
        default="random",
        help="random[:low=,high=], chat, jsonl:path=FILE, shared-prefix:num_prefixes=,prefix_len=, "
        "multiturn:turns=,system_len=[,think_s=] (see above)",
    )
    parser.add_argument("--input-len", default="fixed:128", help="prompt length distribution (tokens)")
    parser.add_argument("--output-len", default="fixed:128", help="output length distribution (max_tokens)")
    parser.add_argument("--arrival", default="poisson:rate=4", help="arrival process (see above)")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="stop scheduling after this many (sessions, for multiturn)"
    )
    parser.add_argument("--duration", type=duration_arg, default=None, help="stop scheduling after this long (60s)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="client-side cap (reported as such)")
    parser.add_argument(
        "--workers",
        type=_worker_count,
        default=1,
        help="processes that share the sending (past what one client core sustains: see client-capacity)",
    )
    parser.add_argument("--request-timeout", type=duration_arg, default=600.0, help="whole-request limit")
    parser.add_argument("--stall-timeout", type=duration_arg, default=30.0, help="longest gap between two tokens")
    add_retries_argument(parser)
    parser.add_argument("--no-exact-output", action="store_true", help="do not send ignore_eos / min_tokens")
    parser.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    parser.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompts")
    parser.add_argument("--slo", default=None, help="e.g. ttft_p99=2s,tpot_p99=200ms (adds goodput)")
    parser.add_argument("--prometheus-url", default=None, help="Prometheus server to read the server's metrics from")
    parser.add_argument("--fault-windows", type=Path, default=None, help="JSON [{name,start_unix,end_unix}]")
    parser.add_argument("--results-dir", type=Path, default=Path("bench-results"), help="where JSON + HTML go")
    parser.add_argument("--bucket", type=duration_arg, default=1.0, help="time-series bucket of the report")
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"run a plan above {MAX_PLAN_TOKENS:,} tokens (requests x mean prompt + output tokens, plus shared "
        "prefixes; about 4 GB of prompts): refused without it, before anything is built or sent",
    )


def add_retries_argument(parser: argparse.ArgumentParser) -> None:
    """``--retries``, as ``kvstorm bench serve`` and ``kvstorm simulate run`` both take it."""
    parser.add_argument(
        "--retries",
        type=_retry_count,
        default=0,
        help="send a request refused with 429 or 503 again after its Retry-After, up to this many times "
        "(OpenAI's Python SDK: 2; default 0: a refusal ends the request)",
    )


def _retry_count(text: str) -> int:
    count = int(text)
    if not 0 <= count <= MAX_RETRIES:
        raise argparse.ArgumentTypeError(f"must be in 0-{MAX_RETRIES}, got {count}")
    return count


def add_bench_client_capacity_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "client-capacity",
        help="streamed tokens/s and concurrent streams one client core sustains with timing error under 1 ms",
        description=CAPACITY_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--levels", default="100,200,300,400,500,600", help="concurrent streams to try, in order")
    parser.add_argument("--ttft", type=duration_arg, default=0.05, help="scripted time to the first token")
    parser.add_argument("--gap", type=duration_arg, default=0.02, help="scripted gap between tokens")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument("--steady", type=duration_arg, default=4.0, help="how long each level keeps its streams open")
    parser.add_argument(
        "--workers", type=_worker_counts, default=[1], help="client processes to try, in order (e.g. 1,2)"
    )


def run_bench_client_capacity(args: argparse.Namespace) -> BenchReport:
    levels = [int(level) for level in args.levels.split(",")]
    load_before = os.getloadavg()[0]
    placements, rows = {}, {}
    for workers in args.workers:
        placements[workers] = Placement.for_workers(workers)
        rows[workers] = measure_capacity(
            levels, ttft_s=args.ttft, gap_s=args.gap, num_tokens=args.tokens, steady_s=args.steady, workers=workers
        )
    load_after = os.getloadavg()[0]
    lines = [
        f"Scripted server (TTFT {args.ttft * 1e3:g} ms, one token every {args.gap * 1e3:g} ms, {args.tokens} tokens "
        f"per stream) alone on its CPU, the client's processes at real-time priority where allowed; Poisson arrivals "
        f"at the rate that keeps each level's streams open, for {args.steady:g} s. Timing error: the client's "
        "recorded arrival of each token minus the server's stamp after writing it (same monotonic clock). Client CPU: "
        "the client processes' CPU time over the steady window, in cores. "
        f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_kind()}), Python {platform.python_version()}, event loop "
        f"uvloop; load average {load_before:.2f} before, {load_after:.2f} after.",
    ]
    for workers, placement in placements.items():
        lines += [
            "",
            f"**{workers} worker process{'es' if workers > 1 else ''}**: {placement.describe()}.",
            "",
            "| streams (target / peak) | tokens/s | client CPU | server CPU | error p50 ms | error p99 ms "
            "| error max ms | server late p99 ms | failed | under 1 ms |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows[workers]:
            lines.append(
                f"| {row.target_streams} / {row.peak_streams} | {row.tokens_per_s:.0f} | {row.client_cpu:.0%} "
                f"| {row.server_cpu:.0%} | {row.error_p50_ms:.2f} | {row.error_p99_ms:.2f} | {row.error_max_ms:.2f} "
                f"| {row.server_late_p99_ms:.2f} | {row.num_failed} | {'yes' if row.sustained else 'no'} |"
            )
        lines.append("")
        lines.append(_capacity_conclusion(workers, placement, rows[workers]))
    return BenchReport("\n".join(lines))


def _capacity_conclusion(workers: int, placement: Placement, rows: list[CapacityRow]) -> str:
    sustained = [row for row in rows if row.sustained]
    processes = f"{workers} worker process{'es' if workers > 1 else ''}"
    if not sustained:
        return f"With {processes}, no level kept the p99 timing error under 1 ms."
    best = max(sustained, key=lambda row: row.tokens_per_s)
    cores = f"{placement.client_cores} client core{'s' if placement.client_cores > 1 else ''}"
    return (
        f"{processes} on {cores}: **{best.peak_streams} concurrent streams "
        f"({best.streams_per_core:.0f} per client core), {best.tokens_per_s:.0f} streamed tokens/s** sustained with "
        f"p99 timing error {best.error_p99_ms:.2f} ms (client CPU {best.client_cpu:.0%})."
    )


def run_bench_serve(args: argparse.Namespace) -> BenchReport:
    config = RunConfig(
        base_url=args.base_url,
        model=args.model,
        arrival=args.arrival,
        workload=args.workload,
        input_len=args.input_len,
        output_len=args.output_len,
        num_requests=args.num_requests,
        duration_s=args.duration,
        max_concurrency=args.max_concurrency,
        workers=args.workers,
        retries=args.retries,
        request_timeout_s=args.request_timeout,
        stall_timeout_s=args.stall_timeout,
        exact_output=not args.no_exact_output,
        seed=args.seed,
        slo=args.slo,
    )
    if not args.force:
        plan_size(config).check(remedy="; --force runs it anyway")
    fault_windows = read_fault_windows(args.fault_windows) if args.fault_windows else []
    benchmark = run_benchmark(
        config,
        fault_windows=fault_windows,
        prometheus_url=args.prometheus_url,
        extra_body=args.extra_body,
        api_key=args.api_key,
        show_progress=not args.no_progress,
        announce=print,
    )
    try:
        result = run_event_loop(benchmark)
    except RunCutShort as cut:  # interrupted, or a load worker lost: what ended is written all the same
        if cut.result is None:
            raise
        result = cut.result
    stem = f"serve-{time.strftime('%Y%m%d-%H%M%S', time.localtime(result.start_unix))}-{result.run_id}"
    json_path, html_path = args.results_dir / f"{stem}.json", args.results_dir / f"{stem}.html"
    result.write(json_path)
    write_report(result, html_path, bucket_s=args.bucket)
    failures = [] if result.summary.outcomes[Outcome.OK] else ["no request succeeded"]
    if result.cut_short is not None:
        failures.append(f"the run was cut short: {result.cut_short}")
    markdown = f"{summary_markdown(result)}\n\nResults: `{json_path}`, report: `{html_path}`"
    return BenchReport(markdown, failures=failures)
