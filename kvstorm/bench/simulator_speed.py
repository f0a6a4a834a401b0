"""``kvstorm bench simulator-speed``: how fast the simulator runs, in requests simulated per second of one core.

Poisson arrivals with drawn prompt and output lengths go straight to ``engine.core.simulator`` (no prompts, no
results file: what is timed is the engine's side), with a profile's engine and costs.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from engine.core.simulator import SimulatedArrival, Simulation
from kernels.cpu_isa import cpu_kind
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import cpu_name
from kvstorm.simulate.profiles import load_profile, simulated_engine
from loadgen.arrivals import make_arrivals
from loadgen.workloads import sample_lengths

# The goal: a million requests of a Poisson workload in under a minute on one core.
GOAL_REQUESTS, GOAL_S = 1_000_000, 60.0


def add_bench_simulator_speed_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "simulator-speed", help="requests simulated per second of one core (the engine's side of kvstorm simulate)"
    )
    parser.add_argument("--profile", default="h200-llama-3-8b")
    parser.add_argument("--num-requests", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second")
    parser.add_argument("--input-len", default="lognormal:median=512,sigma=0.5")
    parser.add_argument("--output-len", default="lognormal:median=128,sigma=0.5")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)


def run_bench_simulator_speed(args: argparse.Namespace) -> BenchReport:
    profile = load_profile(args.profile)
    engine = simulated_engine(profile, num_kv_blocks=args.num_kv_blocks)
    arrivals = make_arrivals(f"poisson:rate={args.rate:g}", num_requests=args.num_requests, duration_s=None)
    rng = np.random.default_rng(args.seed)
    prompts = sample_lengths(args.input_len, len(arrivals), rng)
    outputs = sample_lengths(args.output_len, len(arrivals), rng)
    simulated_arrivals = [
        SimulatedArrival(index, arrival.offset_s, int(prompt), int(output))
        for index, (arrival, prompt, output) in enumerate(zip(arrivals, prompts, outputs, strict=True))
    ]
    started = time.perf_counter()
    result = Simulation(engine, simulated_arrivals, keep_steps=False).run()
    wall_s = time.perf_counter() - started
    ok = sum(1 for request in result.requests if request.outcome == "ok")
    tokens = sum(len(request.token_times_s) for request in result.requests)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if len(arrivals) < GOAL_REQUESTS:
        verdict = f"not measured by this run of {len(arrivals):,}"
    else:
        verdict = "met" if wall_s < GOAL_S else "**not met**"
    markdown = (
        f"{len(arrivals):,} requests, Poisson at {args.rate:g}/s, input `{args.input_len}`, "
        f"output `{args.output_len}`, through {profile.name} ({engine.num_device_blocks} KV blocks): "
        f"{result.end_s:,.0f} s of virtual time, "
        f"{result.num_steps:,} steps, {tokens:,} tokens, {ok:,} ok, "
        f"{sum(result.preemptions.values()):,} preemptions.\n\n"
        f"Simulated in **{wall_s:.1f} s** on one core of {cpu_name()} ({cpu_kind()}): "
        f"{len(arrivals) / wall_s:,.0f} requests/s, {tokens / wall_s / 1e6:.2f} M tokens/s; peak memory "
        f"{peak_gib:.1f} GiB. The goal, {GOAL_REQUESTS:,} requests in under {GOAL_S:g} s: {verdict}."
    )
    return BenchReport(markdown)
