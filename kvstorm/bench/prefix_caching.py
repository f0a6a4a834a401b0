"""``kvstorm bench prefix-caching``: multi-turn conversations that share a long system prompt, through the server,
with kvstorm's prefix cache on, with it off, and against vLLM-CPU with its own prefix caching, one after the other
through the same client (``loadgen``), each server started fresh (a cold cache) for its run.

The workload (``loadgen.sessions``): ``--sessions`` sessions arriving as a Poisson process at ``--rate`` per second,
each of ``--turns`` turns: a system prompt of about ``--system-len`` tokens every session shares, user messages of
``--input-len`` tokens, answers of ``--output-len`` tokens (greedy, exact length), ``--think`` seconds between an
answer and the next question. The hit rate is each server's own (``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total``, scraped before and after its run). Targets: kvstorm with its cache at least
``TARGET_SPEEDUP`` times better in TTFT p50 than without, and no worse than vLLM-CPU's."""

from __future__ import annotations

import argparse
import platform
import shlex
from dataclasses import dataclass

from chaos.injectors.processes import kvstorm_server
from engine.model.registry import native_bfloat16_cpu_feature
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import ServerHitRate, add_server_arguments, cpu_name, run_with_hit_rate, vllm_server
from loadgen.analysis import Summary
from loadgen.benchmark import run_benchmark
from loadgen.results import RunConfig

TARGET_SPEEDUP = 3.0


@dataclass(frozen=True)
class TargetRun:
    name: str
    summary: Summary
    hit_rate: ServerHitRate


def add_bench_prefix_caching_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "prefix-caching",
        help="multi-turn chat: kvstorm's prefix cache on vs off vs vLLM-CPU's, same client, one sitting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=1000, help="tokens of the shared system prompt (about)")
    parser.add_argument("--input-len", default="fixed:48", help="each user message (tokens)")
    parser.add_argument("--output-len", default="fixed:32", help="each answer (tokens)")
    parser.add_argument("--think", default="1s", help="between an answer and the next question")
    parser.add_argument("--rate", type=float, default=1.0, help="sessions per second (Poisson)")
    add_server_arguments(parser, "kvstorm serve's arguments, both kvstorm runs")


def run_bench_prefix_caching(args: argparse.Namespace) -> BenchReport:
    runs = []
    for name, extra in (("kvstorm, prefix cache on", []), ("kvstorm, prefix cache off", ["--no-prefix-caching"])):
        serve_args = ["--served-model-name", "smollm2", *shlex.split(args.server_args), *extra]
        with kvstorm_server(serve_args) as kvstorm:
            runs.append(_measure(name, kvstorm.url, args))
    if args.vllm_command:
        with vllm_server(args.vllm_command) as url:
            runs.append(_measure("vLLM-CPU 0.32.0, its prefix caching (on by default)", url, args))
    return _report(runs, args)


def _measure(name: str, url: str, args: argparse.Namespace) -> TargetRun:
    config = RunConfig(
        base_url=url,
        model="smollm2",
        arrival=f"poisson:rate={args.rate:g}",
        workload=f"multiturn:turns={args.turns},system_len={args.system_len},think_s={args.think}",
        input_len=args.input_len,
        output_len=args.output_len,
        num_requests=args.sessions,
        duration_s=None,
        max_concurrency=None,
        request_timeout_s=600.0,
        stall_timeout_s=60.0,
        exact_output=True,
        seed=0,
        slo=None,
    )
    result, hit_rate = run_with_hit_rate(url, run_benchmark(config, extra_body={"temperature": 0}, show_progress=False))
    return TargetRun(name, result.summary, hit_rate)


def _report(runs: list[TargetRun], args: argparse.Namespace) -> BenchReport:
    lines = [
        f"{args.sessions} sessions of {args.turns} turns (Poisson, {args.rate:g} sessions/s): a system prompt of about "
        f"{args.system_len} tokens every session shares, user messages `{args.input_len}`, answers "
        f"`{args.output_len}` (greedy, exact), {args.think} between an answer and the next question. Each server "
        f"fresh for its run; one client (`loadgen`); {platform.machine()}, {cpu_name()} "
        f"({native_bfloat16_cpu_feature() or 'no native bfloat16'}). kvstorm: "
        f"`{args.server_args}`; vLLM: `{args.vllm_command or '(not run)'}`.",
        "",
        "| server | TTFT p50 ms | TTFT p99 ms | output tok/s | ok / sent | sessions completed | hit rate (server's) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = run.summary
        ttft = s.ttft
        p50, p99 = ("-", "-") if ttft is None else (f"{ttft.p50 * 1e3:.0f}", f"{ttft.p99 * 1e3:.0f}")
        sessions = "-" if s.sessions is None else f"{s.sessions.completed} / {s.sessions.num_sessions}"
        lines.append(
            f"| {run.name} | {p50} | {p99} | {s.output_token_throughput:.1f} | {s.outcomes['ok']} / "
            f"{s.num_requests} | {sessions} | {run.hit_rate} |"
        )
    lines += ["", "TTFT p50 by turn (ms):", "", "| turn | " + " | ".join(run.name for run in runs) + " |"]
    lines.append("|---|" + "---|" * len(runs))
    for turn in range(1, args.turns + 1):
        cells = [_turn_p50(run.summary, turn) for run in runs]
        lines.append(f"| {turn} | " + " | ".join(cells) + " |")
    verdicts, failures = _verdicts(runs)
    lines += ["", *verdicts]
    data = {run.name: {"summary": run.summary.model_dump(mode="json"), "hit_rate": run.hit_rate.value} for run in runs}
    return BenchReport("\n".join(lines), data=data, failures=failures)


def _turn_p50(summary: Summary, turn: int) -> str:
    stats = next((t for t in summary.turns or () if t.turn == turn), None)
    return "-" if stats is None or stats.ttft is None else f"{stats.ttft.p50 * 1e3:.0f}"


def _verdicts(runs: list[TargetRun]) -> tuple[list[str], list[str]]:
    """The targets in words, each met only on positive evidence; failures: runs whose numbers mean nothing."""
    failures = [f"{run.name}: no request succeeded" for run in runs if run.summary.ttft is None]
    if failures:
        return [], failures
    on, off = runs[0].summary.ttft.p50, runs[1].summary.ttft.p50
    speedup = off / on
    lines = [
        f"kvstorm's prefix cache: TTFT p50 **{speedup:.2f}x** better than without "
        f"(target >= {TARGET_SPEEDUP:g}x: {'met' if speedup >= TARGET_SPEEDUP else 'NOT met'})."
    ]
    if len(runs) > 2:
        vllm = runs[2].summary.ttft.p50
        lines.append(
            f"Against vLLM-CPU: kvstorm's TTFT p50 {on * 1e3:.0f} ms, vLLM-CPU's {vllm * 1e3:.0f} ms: "
            f"**{vllm / on:.2f}x** lower (target: no higher than vLLM-CPU's: {'met' if on <= vllm else 'NOT met'})."
        )
    else:
        lines.append("vLLM-CPU was not run: the comparison with it is not measured here.")
    return lines, []
