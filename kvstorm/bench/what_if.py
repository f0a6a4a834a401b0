"""``kvstorm bench what-if``: a prediction from a profile, no server needed. At which Poisson rate does the engine of
the profile start preempting with a given KV budget, and what does a KV cap do at that rate?

It simulates ``--duration`` of Poisson arrivals at doubling rates until a run preempts, bisects between the last
rate that did not and the first that did, then runs that rate again with ``--cap`` of the pool taken for the middle
third of the run (the ``kv_cap`` fault), without admission control and with it (at kvstorm serve's default TTFT
objective: what it refuses instead of letting the queue grow). Every number is the simulator's
(``kvstorm simulate``): a prediction resting on the profile's assumptions, which the report repeats.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.core.admission import AdmissionLimits
from engine.core.simulator import FaultWindow, SimulatedEngine
from kvstorm.admission_options import DEFAULT_TTFT_SLO_S, objective
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.serve import duration_arg
from kvstorm.simulate.profiles import RooflineProfile, load_profile, simulated_engine
from kvstorm.simulate.run import SimulatedRun, open_loop_load, simulate
from loadgen.records import Outcome
from loadgen.results import RunConfig

MAX_RATE = 1024.0
TABLE_HEAD = (
    "| run | rate/s | preemptions | TTFT p50 s | TTFT p99 s | TPOT p50 ms | output tok/s | refused | broken "
    "| timed out |\n|---|---|---|---|---|---|---|---|---|---|"
)
BISECTIONS = 4


def add_bench_what_if_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "what-if", help="simulated: the Poisson rate where preemption starts, and a KV cap there (a prediction)"
    )
    parser.add_argument("--profile", default="h200-llama-3-8b", help="a shipped profile or a profile file")
    parser.add_argument("--num-kv-blocks", type=int, default=8192, help="the KV budget in blocks")
    parser.add_argument("--input-len", default="lognormal:median=1024,sigma=0.7")
    parser.add_argument("--output-len", default="lognormal:median=256,sigma=0.7")
    parser.add_argument("--duration", type=duration_arg, default=120.0, help="of each simulated run")
    parser.add_argument("--cap", type=float, default=0.3, help="the KV cap's fraction of the pool")
    parser.add_argument(
        "--ttft-slo",
        type=objective,
        default=DEFAULT_TTFT_SLO_S,
        help=f"the capped run again with admission at this TTFT objective (default {DEFAULT_TTFT_SLO_S:g}s, kvstorm "
        "serve's; off: not run)",
    )
    parser.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class Point:
    rate: float
    run: SimulatedRun

    @property
    def preemptions(self) -> int:
        return sum(self.run.engine_side.preemptions.values())


def run_bench_what_if(args: argparse.Namespace) -> BenchReport:
    if not 0 < args.cap < 1:
        raise ValueError(f"--cap must be a fraction in (0, 1), got {args.cap}")
    profile = load_profile(args.profile)
    engine = simulated_engine(profile, num_kv_blocks=args.num_kv_blocks)

    def at(rate: float, faults: list[FaultWindow] | None = None, admission: AdmissionLimits | None = None) -> Point:
        config = _config(args, rate)
        faults_on_one = [(window, [0]) for window in faults or []]
        return Point(rate, simulate(config, engine, profile.name, faults_on_one, admission=admission))

    sweep = [at(1.0)]
    while sweep[-1].preemptions == 0 and sweep[-1].rate < MAX_RATE:
        sweep.append(at(sweep[-1].rate * 2))
    if sweep[-1].preemptions == 0:
        return BenchReport(f"No preemption up to {MAX_RATE:g} requests/s.", failures=["no preemption found"])
    calm = sweep[-2].rate if len(sweep) > 1 else 0.0
    onset = sweep[-1]
    for _ in range(BISECTIONS):
        middle = at((calm + onset.rate) / 2)
        sweep.append(middle)
        if middle.preemptions:
            onset = middle
        else:
            calm = middle.rate
    third = args.duration / 3
    cap = [FaultWindow("kv_cap", third, 2 * third, {"kv_cap": {"fraction": args.cap}})]
    capped = [(f"{args.cap:.0%} cap, middle third", at(onset.rate, cap))]
    if args.ttft_slo is not None:
        label = f"{args.cap:.0%} cap, admission at {args.ttft_slo:g} s"
        capped.append((label, at(onset.rate, cap, AdmissionLimits(ttft_slo_s=args.ttft_slo))))
    return BenchReport(_markdown(args, profile, engine, sorted(sweep, key=lambda p: p.rate), onset, capped))


def _config(args: argparse.Namespace, rate: float) -> RunConfig:
    return open_loop_load(
        f"simulated ({args.profile})",
        "simulated",
        f"poisson:rate={rate:.4g}",
        args.input_len,
        args.output_len,
        duration_s=args.duration,
        seed=args.seed,
    )


def _row(label: str, point: Point) -> str:
    s = point.run.result.summary
    ttft, tpot, outcomes = s.ttft, s.tpot, s.outcomes
    side = point.run.engine_side
    return (
        f"| {label} | {point.rate:.3g} | {point.preemptions} ({side.preemptions['swap']} swap) | "
        f"{ttft.p50 if ttft else 0:.3f} | {ttft.p99 if ttft else 0:.3f} | {(tpot.p50 if tpot else 0) * 1e3:.1f} | "
        f"{s.output_token_throughput:.0f} | {outcomes[Outcome.REJECTED]} | {outcomes[Outcome.BROKEN_STREAM]} | "
        f"{outcomes[Outcome.CLIENT_TIMEOUT]} |"
    )


def _markdown(
    args, profile, engine: SimulatedEngine, sweep: list[Point], onset: Point, capped: list[tuple[str, Point]]
) -> str:
    kv_tokens = engine.num_device_blocks * engine.block_size
    gib = engine.num_device_blocks * engine.bytes_per_block / 2**30
    lines = [
        f"**A prediction, not a measurement**: {profile.name}. KV budget {engine.num_device_blocks} blocks "
        f"({kv_tokens} tokens, {gib:.1f} GiB), {engine.num_host_blocks} swap blocks; Poisson arrivals for "
        f"{args.duration:g} s, input `{args.input_len}`, output `{args.output_len}` (exact), seed {args.seed}.",
        "",
        f"Preemption starts at about **{onset.rate:.3g} requests/s** (the lowest rate simulated that preempted). "
        f"There, a cap to {args.cap:.0%} of the KV pool from {args.duration / 3:g} s to {2 * args.duration / 3:g} s, "
        "without admission control, and with it (refused: a 400 for a request longer than the context, or a 429 from "
        "admission, which these clients do not retry; TTFT and TPOT are the admitted requests'):",
        "",
        TABLE_HEAD,
        _row("at the onset", onset),
        *(_row(label, point) for label, point in capped),
        "",
        "The sweep (no admission control):",
        "",
        TABLE_HEAD,
        *(_row("sweep", point) for point in sweep),
    ]
    if isinstance(profile, RooflineProfile):
        lines += ["", "The profile's assumptions:", "", *(f"- {a}" for a in profile.assumptions)]
    return "\n".join(lines)
