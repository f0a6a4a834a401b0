"""Serving overhead: the w1 workload through `kvstorm serve` (SSE streams) against the offline engine, same run.

Both run in child processes with the same engine options, the offline engine
first and last with the server between (this machine's speed drifts; the ratio
uses the faster offline run, so drift cannot flatter the server). The offline
engine steps with every request submitted at once; the server gets all requests
at once as concurrent streams from this process (aiohttp), and its throughput is
output tokens over the time from the first send to the last [DONE]. The ratio
says what the HTTP side costs the engine (the engine loop runs in a thread of
the server process). A small client until `kvstorm bench serve` exists. Writes
the "serving-overhead" section of docs/benchmarks.md.

    .venv/bin/python scripts/bench_serve.py [--num-requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time

import aiohttp

from engine.bench_offline import w1_throughput
from engine.bench_process import run_child
from kvstorm.benchdoc import update_section

ENGINE_ARGS = ["--model", "smollm2-135m", "--kv-cache-memory", "4GiB", "--swap-space", "0", "--max-num-seqs", "256"]
OFFLINE_SCRIPT = """
import json, sys
from engine.bench_offline import run_kvstorm, w1_throughput
options = dict(kv_cache_memory=4 << 30, swap_space=0, max_num_seqs=256)
print("RESULT", json.dumps(run_kvstorm(w1_throughput(int(sys.argv[1])), options)))
"""


def run_offline(num_requests: int) -> float:
    child = run_child([sys.executable, "-c", OFFLINE_SCRIPT, str(num_requests)])
    result = json.loads(child.output.split("RESULT ", 1)[1])
    return result["output_tokens"] / result["elapsed_s"]


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of each token chunk, relative to the send."""
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    start = time.perf_counter()
    arrivals = []
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                arrivals.append(time.perf_counter() - start)
    if len(arrivals) != max_tokens:
        raise RuntimeError(f"expected {max_tokens} chunks, got {len(arrivals)}")
    return arrivals


async def run_streams(url: str, num_requests: int) -> tuple[float, list[list[float]]]:
    workload = w1_throughput(num_requests)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        streams = await asyncio.gather(
            *(stream_one(session, url, p, n) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
        )
        elapsed = time.perf_counter() - start
    return workload.num_output_tokens / elapsed, streams


def run_served(num_requests: int) -> tuple[float, list[list[float]]]:
    server = subprocess.Popen(
        [sys.executable, "-m", "kvstorm", "serve", *ENGINE_ARGS, "--port", "0"], stderr=subprocess.PIPE, text=True
    )
    try:
        url = next(line.strip().rsplit(" ", 1)[-1] for line in server.stderr if "listening on " in line)
        return asyncio.run(run_streams(url, num_requests))
    finally:
        server.terminate()
        server.wait(60)


def percentiles(values: list[float]) -> str:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return " / ".join(f"{cuts[p - 1] * 1000:.0f}" for p in (50, 90, 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    offline_first = run_offline(args.num_requests)
    served, streams = run_served(args.num_requests)
    offline_last = run_offline(args.num_requests)
    offline = max(offline_first, offline_last)
    ttfts = [s[0] for s in streams]
    gaps = [b - a for s in streams for a, b in itertools.pairwise(s)]
    markdown = (
        "## Serving overhead (`scripts/bench_serve.py`)\n\n"
        f"w1-throughput, {args.num_requests} requests as {args.num_requests} concurrent SSE streams through "
        "`kvstorm serve` (engine loop in a thread of the server process), against the offline engine with the same "
        "options in the same run; float32 on this machine's CPU, SmolLM2-135M.\n\n"
        "| run | output tok/s |\n|---|---|\n"
        f"| offline engine (first) | {offline_first:.1f} |\n| served (HTTP + SSE) | {served:.1f} |\n"
        f"| offline engine (last) | {offline_last:.1f} |\n\n"
        f"Served / faster offline run: **{served / offline:.0%}**. "
        f"TTFT p50 / p90 / p99: {percentiles(ttfts)} ms; ITL p50 / p90 / p99: {percentiles(gaps)} ms "
        "(all requests arrive at once, so TTFT includes the queue behind every other prompt).\n\n"
        f"Reproduce: `.venv/bin/python scripts/bench_serve.py --num-requests {args.num_requests}` "
        f"({time.strftime('%Y-%m-%d')})"
    )
    print(markdown)
    if not args.no_docs:
        update_section("serving-overhead", markdown)


if __name__ == "__main__":
    main()
