"""Load-generation subcommands of the ``kvstorm`` command line (``kvstorm bench serve``, ``client-capacity``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from loadgen.arrivals import __doc__ as ARRIVALS_DOC
from loadgen.benchmark import run_benchmark, summary_markdown
from loadgen.report import write_report
from loadgen.results import RunConfig, read_fault_windows
from loadgen.spec import parse_duration
from loadgen.workloads import __doc__ as WORKLOADS_DOC


@dataclass(frozen=True)
class BenchReport:
    markdown: str


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
    parser.add_argument("--workload", default="random", help="random[:low=,high=], chat, jsonl:path=FILE")
    parser.add_argument("--input-len", default="fixed:128", help="prompt length distribution (tokens)")
    parser.add_argument("--output-len", default="fixed:128", help="output length distribution (max_tokens)")
    parser.add_argument("--arrival", default="poisson:rate=4", help="arrival process (see above)")
    parser.add_argument("--num-requests", type=int, default=None, help="stop scheduling after this many")
    parser.add_argument("--duration", type=_duration, default=None, help="stop scheduling after this long (60s)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="client-side cap (reported as such)")
    parser.add_argument("--request-timeout", type=_duration, default=600.0, help="whole-request limit")
    parser.add_argument("--stall-timeout", type=_duration, default=30.0, help="longest gap between two tokens")
    parser.add_argument("--no-exact-output", action="store_true", help="do not send ignore_eos / min_tokens")
    parser.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    parser.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompts")
    parser.add_argument("--slo", default=None, help="e.g. ttft_p99=2s,tpot_p99=200ms (adds goodput)")
    parser.add_argument("--prometheus-url", default=None, help="Prometheus server to read the server's metrics from")
    parser.add_argument("--fault-windows", type=Path, default=None, help="JSON [{name,start_unix,end_unix}]")
    parser.add_argument("--results-dir", type=Path, default=Path("bench-results"), help="where JSON + HTML go")
    parser.add_argument("--bucket", type=_duration, default=1.0, help="time-series bucket of the report")
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")


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
        request_timeout_s=args.request_timeout,
        stall_timeout_s=args.stall_timeout,
        exact_output=not args.no_exact_output,
        seed=args.seed,
        slo=args.slo,
    )
    fault_windows = read_fault_windows(args.fault_windows) if args.fault_windows else []
    result = asyncio.run(
        run_benchmark(
            config,
            fault_windows=fault_windows,
            prometheus_url=args.prometheus_url,
            extra_body=args.extra_body,
            api_key=args.api_key,
            show_progress=not args.no_progress,
        )
    )
    stem = f"serve-{time.strftime('%Y%m%d-%H%M%S', time.localtime(result.start_unix))}-{result.run_id}"
    json_path, html_path = args.results_dir / f"{stem}.json", args.results_dir / f"{stem}.html"
    result.write(json_path)
    write_report(result, html_path, bucket_s=args.bucket)
    return BenchReport(f"{summary_markdown(result)}\n\nResults: `{json_path}`, report: `{html_path}`")
