"""``kvstorm bench serving-overhead``: serving speed, w1 through `kvstorm serve` against the offline engine and the
matmul roofline, and a single stream, in bfloat16 and float32, one run.

Per dtype, each part in its own child process with the same engine options:

- w1-throughput: offline and served runs alternate, offline first and last (offline, served, offline, served,
  offline, served, offline): this machine's speed drifts by up to 20% within minutes, so a served run is compared
  with the mean of the two offline runs around it (a drift steady over those minutes cancels), and the ratio
  reported is the mean over the served runs. The server (admission off: it would refuse part of a burst this
  size) gets every request at once as concurrent SSE streams from the load generator (greedy, exact output
  lengths, every stream checked); its throughput is output tokens over the time from the first send to the last
  [DONE]. What the HTTP side costs is also measured directly, free of drift: the CPU time of the server's event
  loop thread and of the load generator (the same machine's two cores) during each served run. The roofline is
  the fastest square matmul in that dtype, measured in every offline child, before and after its run (the best
  counts).
- Single stream: the offline engine decoding one request (128-token prompt, 256 tokens, greedy), then the server
  with one request at a time (128 / 128 tokens, sampled at temperature 1 as a client's default) and with Poisson
  arrivals at 1 request/s (128 / 64 tokens, 30 s).

    kvstorm bench serving-overhead [--num-requests 128] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from chaos.injectors.processes import kvstorm_server
from kvstorm.bench.child import run_in_child
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.w1 import count_flops, w1_throughput
from loadgen.analysis import Summary, summarize
from loadgen.benchmark import run_benchmark
from loadgen.capacity import own_cpu_s, process_cpu_s
from loadgen.client import StreamingClient
from loadgen.records import Outcome
from loadgen.results import RunConfig
from loadgen.runner import run_event_loop, run_open_loop
from loadgen.workloads import PlannedRequest

MODEL = "smollm2-135m"
ENGINE_ARGS = ["--model", MODEL, "--kv-cache-memory", "4GiB", "--swap-space", "0", "--max-num-seqs", "256"]


@dataclass(frozen=True)
class OfflineRun:
    """Output tok/s of one offline run, and the roofline measured around it (w1 only)."""

    tokens_per_s: float
    roofline_gflops: float | None = None


def offline_w1(dtype: str, num_requests: int) -> OfflineRun:
    """In a child process (``kvstorm.bench.child``): w1 through the offline engine, with the fastest square matmul
    measured before and after it (the best counts)."""
    import torch

    from engine.model.registry import resolve_dtype
    from kvstorm.bench.offline import measure_matmul_gflops, run_kvstorm

    cpu = torch.device("cpu")
    roofline = max(measure_matmul_gflops(cpu, resolve_dtype(dtype, cpu)).values())
    options = {"dtype": dtype, "kv_cache_memory": 4 << 30, "swap_space": 0, "max_num_seqs": 256}
    result = run_kvstorm(w1_throughput(num_requests), options)
    roofline = max(roofline, *measure_matmul_gflops(cpu, resolve_dtype(dtype, cpu)).values())
    return OfflineRun(result["output_tokens"] / result["elapsed_s"], roofline)


def offline_single_stream(dtype: str) -> OfflineRun:
    """In a child process: one request (128-token prompt, 256 tokens, greedy) decoding alone."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLM

    engine = LLM(MODEL, dtype=dtype, kv_cache_memory=256 << 20, swap_space=0).engine
    engine.add_request(list(range(1000, 1128)), SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill and the first token
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return OfflineRun(steps / (time.perf_counter() - start))


SERVED_RUNS = 3  # each between two offline runs


@dataclass
class ServedRun:
    summary: Summary
    event_loop_cpu_s: float  # the server's main thread: HTTP, JSON, SSE writes
    client_cpu_s: float  # the load generator, in this process

    @property
    def tokens_per_s(self) -> float:
        return self.summary.output_token_throughput


@dataclass
class DtypeResult:
    dtype: str
    offline: list[float]  # output tok/s of each offline run, in order
    served: list[ServedRun]  # each served run, in order: served[i] ran between offline[i] and offline[i + 1]
    roofline_gflops: float
    offline_single_stream: float
    one_at_a_time: Summary
    one_per_second: Summary

    def bracketed_ratios(self) -> list[float]:
        """Each served run over the mean of the offline runs just before and after it."""
        return [
            run.tokens_per_s / ((before + after) / 2)
            for run, before, after in zip(self.served, self.offline[:-1], self.offline[1:], strict=True)
        ]

    @property
    def served_over_offline(self) -> float:
        ratios = self.bracketed_ratios()
        return sum(ratios) / len(ratios)


async def run_w1_streams(url: str, num_requests: int) -> Summary:
    """All of w1 at once through the load generator (greedy, exact output lengths, every stream checked)."""
    workload = w1_throughput(num_requests)
    plan = [
        PlannedRequest(index=i, offset_s=0.0, path="/v1/completions", body={"prompt": prompt}, max_tokens=max_tokens)
        for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))
    ]
    client = StreamingClient(url, MODEL, request_timeout_s=3600, stall_timeout_s=3600, extra_body={"temperature": 0})
    async with client:
        records, timing = await run_open_loop(plan, client)
    return checked(summarize(records, timing.duration_s), records)


def run_low_load(url: str, arrival: str, num_requests: int | None, duration_s: float, output_len: int) -> Summary:
    config = RunConfig(
        base_url=url,
        model=MODEL,
        arrival=arrival,
        workload="random",
        input_len="fixed:128",
        output_len=f"fixed:{output_len}",
        num_requests=num_requests,
        duration_s=duration_s,
        max_concurrency=1 if num_requests else None,
        request_timeout_s=600,
        stall_timeout_s=60,
        exact_output=True,
        seed=1,
        slo=None,
    )
    result = run_event_loop(run_benchmark(config, show_progress=False))
    return checked(result.summary, result.records)


def checked(summary: Summary, records) -> Summary:
    failed = [r for r in records if r.outcome is not Outcome.OK]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} streams failed, e.g. {failed[0].error}")
    return summary


def served_args(dtype: str) -> list[str]:
    # Admission off: w1 sends everything at once, which a TTFT objective would rightly refuse in part.
    return [*ENGINE_ARGS, "--dtype", dtype, "--ttft-slo", "off"]


def run_served(dtype: str, num_requests: int) -> ServedRun:
    with kvstorm_server(served_args(dtype)) as kvstorm:
        pid = kvstorm.server.process.pid  # the main thread's id too: the event loop's
        event_loop_before, client_before = process_cpu_s(pid, thread_id=pid), own_cpu_s()
        summary = run_event_loop(run_w1_streams(kvstorm.url, num_requests))
        event_loop_cpu_s, client_cpu_s = process_cpu_s(pid, thread_id=pid), own_cpu_s()
    return ServedRun(summary, event_loop_cpu_s - event_loop_before, client_cpu_s - client_before)


def measure(dtype: str, num_requests: int) -> DtypeResult:
    print(f"[bench serve] {dtype}: w1 offline and served in turn; then a single stream", file=sys.stderr, flush=True)
    offline = [run_in_child(offline_w1, OfflineRun, dtype=dtype, num_requests=num_requests)]
    served = []
    for _ in range(SERVED_RUNS):
        served.append(run_served(dtype, num_requests))
        offline.append(run_in_child(offline_w1, OfflineRun, dtype=dtype, num_requests=num_requests))
    single = run_in_child(offline_single_stream, OfflineRun, dtype=dtype)
    with kvstorm_server(served_args(dtype)) as kvstorm:
        one_at_a_time = run_low_load(kvstorm.url, "constant:rate=100", 6, 600, output_len=128)
        one_per_second = run_low_load(kvstorm.url, "poisson:rate=1", None, 30, output_len=64)
    return DtypeResult(
        dtype=dtype,
        offline=[run.tokens_per_s for run in offline],
        served=served,
        roofline_gflops=max(run.roofline_gflops for run in offline),
        offline_single_stream=single.tokens_per_s,
        one_at_a_time=one_at_a_time,
        one_per_second=one_per_second,
    )


def render(results: list[DtypeResult], num_requests: int) -> str:
    from engine.model.registry import resolve_model

    workload = w1_throughput(num_requests)
    nominal_flop = count_flops(resolve_model(MODEL).load_config(), workload).nominal
    output_tokens = workload.num_output_tokens

    def roofline_share(tokens_per_s: float, result: DtypeResult) -> str:
        return f"{nominal_flop * tokens_per_s / output_tokens / 1e9 / result.roofline_gflops:.0%}"

    w1_rows = []
    for r in results:
        w1_rows.append(f"| {r.dtype} | offline engine | {r.offline[0]:.1f} | {roofline_share(r.offline[0], r)} | | |")
        for served, ratio, offline in zip(r.served, r.bracketed_ratios(), r.offline[1:], strict=True):
            tok_s = served.tokens_per_s
            w1_rows += [
                f"| {r.dtype} | served (HTTP + SSE) | {tok_s:.1f} | {roofline_share(tok_s, r)} | {ratio:.1%} "
                f"| {served.event_loop_cpu_s:.2f} + {served.client_cpu_s:.2f} "
                f"({served.summary.duration_s:.0f} s) |",
                f"| {r.dtype} | offline engine | {offline:.1f} | {roofline_share(offline, r)} | | |",
            ]
        w1_rows.append(f"| {r.dtype} | **mean of the served runs** | | | **{r.served_over_offline:.1%}** | |")
    stream_rows = [
        f"| {r.dtype} | {r.offline_single_stream:.1f} ({1000 / r.offline_single_stream:.1f} ms) "
        f"| {ms(r.one_at_a_time.tpot.p50)} | {ms(r.one_at_a_time.ttft.p50)} "
        f"| {ms(r.one_per_second.tpot.p50)} / {ms(r.one_per_second.tpot.p99)} "
        f"| {ms(r.one_per_second.ttft.p50)} / {ms(r.one_per_second.ttft.p99)} | {r.one_per_second.peak_in_flight} |"
        for r in results
    ]
    rooflines = "; ".join(f"{r.dtype} {r.roofline_gflops:.0f} GFLOP/s" for r in results)
    return "\n".join(
        [
            f"Serving speed: w1-throughput ({num_requests} requests, {workload.num_prompt_tokens} prompt + "
            f"{output_tokens} output tokens, greedy, exact lengths) through `kvstorm serve` (admission off) as "
            f"{num_requests} concurrent SSE streams sent at once, against the offline engine with the same options "
            "(4 GiB KV, up to 256 running) in the same run, SmolLM2-135M on this machine's CPU. Share of roofline: "
            "the workload's "
            f"{nominal_flop / 1e12:.2f} TFLOP (2 x parameters per token plus attention) over the wall time, against "
            f"the fastest square matmul in that dtype measured in the same run ({rooflines}). Offline and served "
            "runs alternate, as this machine's speed drifts by up to 20% within minutes: each served run is compared "
            "with the mean of the offline runs just before and after it. The last column is what the HTTP side cost, "
            "free of drift: CPU seconds of the server's event loop thread and of the load generator during the run, "
            "taken from the two cores the engine's two threads compute on.",
            "",
            "| dtype | run, in order | output tok/s | share of roofline | served / mean of the offline runs around it "
            "| CPU s of the server's event loop + the load generator (run's wall time) |",
            "|---|---|---|---|---|---|",
            *w1_rows,
            "",
            "Single stream: the offline engine decoding one request (128-token prompt, 256 tokens, greedy); the "
            "server with one request at a time (128 / 128 tokens, six requests, temperature 1), and with Poisson "
            "arrivals at 1 request/s for 30 s (128 / 64 tokens). Milliseconds.",
            "",
            "| dtype | offline decode tok/s | served alone: TPOT p50 | TTFT p50 | 1 req/s: TPOT p50 / p99 "
            "| TTFT p50 / p99 | peak in flight |",
            "|---|---|---|---|---|---|---|",
            *stream_rows,
        ]
    )


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def add_bench_serving_overhead_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serving-overhead", help="w1 and a single stream through kvstorm serve vs offline")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated")


def run_bench_serving_overhead(args: argparse.Namespace) -> BenchReport:
    results = [measure(dtype, args.num_requests) for dtype in args.dtypes.split(",")]
    return BenchReport(render(results, args.num_requests))
