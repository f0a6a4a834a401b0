"""Serving overhead: the w1 workload through `kvstorm serve` (SSE streams) against the offline engine, same run.

Both run in child processes with the same engine options, the offline engine
first and last with the server between (this machine's speed drifts; the ratio
uses the faster offline run, so drift cannot flatter the server). The offline
engine steps with every request submitted at once; the server gets all requests
at once as concurrent streams from the load generator (loadgen, greedy, exact
output lengths, every stream checked), and its throughput is output tokens over
the time from the first send to the last [DONE]. The ratio
says what the HTTP side costs the engine (the engine loop runs in a thread of
the server process). Writes the "serving-overhead" section of docs/benchmarks.md.

    .venv/bin/python scripts/bench_serve.py [--num-requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from kvstorm.bench.doc import update_section
from kvstorm.bench.process import run_child
from kvstorm.bench.w1 import w1_throughput
from loadgen.analysis import LatencyStats, Summary, summarize
from loadgen.client import StreamingClient
from loadgen.records import Outcome
from loadgen.runner import run_open_loop
from loadgen.workloads import PlannedRequest

ENGINE_ARGS = ["--model", "smollm2-135m", "--kv-cache-memory", "4GiB", "--swap-space", "0", "--max-num-seqs", "256"]
OFFLINE_SCRIPT = """
import json, sys
from kvstorm.bench.offline import run_kvstorm
from kvstorm.bench.w1 import w1_throughput
options = dict(kv_cache_memory=4 << 30, swap_space=0, max_num_seqs=256)
print("RESULT", json.dumps(run_kvstorm(w1_throughput(int(sys.argv[1])), options)))
"""


def run_offline(num_requests: int) -> float:
    child = run_child([sys.executable, "-c", OFFLINE_SCRIPT, str(num_requests)])
    result = json.loads(child.output.split("RESULT ", 1)[1])
    return result["output_tokens"] / result["elapsed_s"]


async def run_streams(url: str, num_requests: int) -> Summary:
    """All of w1 at once through the load generator (greedy, exact output lengths, every stream checked)."""
    workload = w1_throughput(num_requests)
    plan = [
        PlannedRequest(index=i, offset_s=0.0, path="/v1/completions", body={"prompt": prompt}, max_tokens=max_tokens)
        for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))
    ]
    client = StreamingClient(
        url, "smollm2-135m", request_timeout_s=3600, stall_timeout_s=3600, extra_body={"temperature": 0}
    )
    async with client:
        records, timing = await run_open_loop(plan, client)
    broken = [r for r in records if r.outcome is not Outcome.OK]
    if broken:
        raise RuntimeError(f"{len(broken)} of {num_requests} streams failed, e.g. {broken[0].error}")
    return summarize(records, timing.duration_s)


def run_served(num_requests: int) -> Summary:
    server = subprocess.Popen(
        [sys.executable, "-m", "kvstorm", "serve", *ENGINE_ARGS, "--port", "0"], stderr=subprocess.PIPE, text=True
    )
    try:
        url = next(line.strip().rsplit(" ", 1)[-1] for line in server.stderr if "listening on " in line)
        return asyncio.run(run_streams(url, num_requests))
    finally:
        server.terminate()
        server.wait(60)


def percentiles(stats: LatencyStats) -> str:
    return " / ".join(f"{value * 1000:.0f}" for value in (stats.p50, stats.p90, stats.p99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    offline_first = run_offline(args.num_requests)
    summary = run_served(args.num_requests)
    served = summary.output_token_throughput
    offline_last = run_offline(args.num_requests)
    offline = max(offline_first, offline_last)
    markdown = (
        "## Serving overhead (`scripts/bench_serve.py`)\n\n"
        f"w1-throughput, {args.num_requests} requests as {args.num_requests} concurrent SSE streams through "
        "`kvstorm serve` (engine loop in a thread of the server process), against the offline engine with the same "
        "options in the same run; float32 on this machine's CPU, SmolLM2-135M.\n\n"
        "| run | output tok/s |\n|---|---|\n"
        f"| offline engine (first) | {offline_first:.1f} |\n| served (HTTP + SSE) | {served:.1f} |\n"
        f"| offline engine (last) | {offline_last:.1f} |\n\n"
        f"Served / faster offline run: **{served / offline:.0%}**. "
        f"TTFT p50 / p90 / p99: {percentiles(summary.ttft)} ms; ITL p50 / p90 / p99: {percentiles(summary.itl)} ms "
        "(all requests arrive at once, so TTFT includes the queue behind every other prompt).\n\n"
        f"Reproduce: `.venv/bin/python scripts/bench_serve.py --num-requests {args.num_requests}` "
        f"({time.strftime('%Y-%m-%d')})"
    )
    print(markdown)
    if not args.no_docs:
        update_section("serving-overhead", markdown)


if __name__ == "__main__":
    main()
