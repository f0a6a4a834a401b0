"""``kvstorm bench simulator``: the simulator against the real engine on the same loads, same seeds, in one table.

It fits a profile of this machine first (``kvstorm simulate profile`` of a server with the same options), then runs
each case through a fresh ``kvstorm serve`` over HTTP, ``--real-runs`` times (the case's faults set and cleared
through ``/admin/faults`` on its timeline, its TTFT objective given to the server's admission control and the
simulated one), and once through ``kvstorm simulate`` (deterministic). It compares the requests that ended ok (the
others are refused by admission), TTFT p50 / p99, TPOT p50, output throughput and preemptions, and says for each
whether the simulator is within the issue's bounds (counts, latency and throughput 15%, preemptions 20%) of the mean
of the real runs, and how far apart the real runs themselves are: a real engine on a shared machine does not repeat
a tail to 15% (two runs of the burst case: TTFT p99 5.09 and 4.27 s; an earlier one, 7.0 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV, EngineAdmin
from chaos.injectors.processes import kvstorm_server
from chaos.run.metrics import EngineActivity, scrape
from engine.core.admission import AdmissionLimits
from engine.core.simulator import FaultWindow
from engine.model.registry import resolve_model
from kernels.cpu_isa import cpu_kind
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import cpu_name
from kvstorm.engine_commands import DEFAULT_MODEL
from kvstorm.simulate.conversations import ChatTokens, TemplateTokens
from kvstorm.simulate.measure import fitted_profile, served_model
from kvstorm.simulate.profiles import load_profile, simulated_engine
from kvstorm.simulate.run import open_loop_load, simulate
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.results import FaultWindow as ReportedWindow
from loadgen.results import RunConfig, RunResult, write_text_atomic
from loadgen.runner import run_event_loop
from loadgen.spec import parse_duration

DEFAULT_SERVER_ARGS = "--num-kv-blocks 1024 --swap-space 256MiB --ttft-slo off"
LATENCY_BOUND = 0.15
PREEMPTION_BOUND = 0.20


@dataclass(frozen=True)
class Case:
    arrival: str
    input_len: str
    output_len: str
    num_requests: int | None = None
    duration_s: float | None = None
    num_kv_blocks: int | None = None
    fault: FaultWindow | None = None
    workload: str = "random"
    # The server's TTFT objective (``--ttft-slo``), which its admission control and the simulated one keep.
    ttft_slo: str | None = None
    # How many times a client sends a request refused with 429 again (``--retries``), on both sides.
    retries: int = 0


CASES = {
    # w1: 128 requests at once (within 0.13 s), the throughput workload of kvstorm bench offline.
    "w1": Case("constant:rate=1000", "uniform:64-512", "uniform:32-256", num_requests=128),
    "poisson": Case("poisson:rate=1.5", "uniform:64-512", "uniform:32-256", duration_s=60),
    "poisson-busy": Case("poisson:rate=3", "uniform:64-512", "uniform:32-256", duration_s=60),
    # The burst-with-vram-cap experiment's shapes, its burst at 5 requests/s: a 30% KV cap from 8 s to 33 s.
    "burst-kv-cap": Case(
        "onoff:base=0.5,burst=5,burst_s=10,period_s=60",
        "uniform:64-192",
        "uniform:32-96",
        duration_s=60,
        num_kv_blocks=88,
        fault=FaultWindow("kv_cap", 8.0, 33.0, {"kv_cap": {"fraction": 0.3}}),
    ),
    # Conversations of 4 turns sharing a system prompt, each turn sent a second after the answer before it: every
    # turn finds the conversation so far in the prefix cache. 120 conversations: with 30, the p99 of their 100-odd
    # turns was the largest one or two, and two real runs put it 17% apart.
    "multiturn": Case(
        "poisson:rate=0.5",
        "uniform:32-128",
        "uniform:32-128",
        duration_s=240,
        workload="multiturn:turns=4,system_len=300,think_s=1",
    ),
    # Several times what the engine serves, under a TTFT objective: admission refuses what would miss it.
    "admission": Case("poisson:rate=10", "uniform:64-512", "uniform:32-256", duration_s=60, ttft_slo="3s"),
    # The same, with clients that send a refused request again after its Retry-After, twice at most (OpenAI's SDK).
    "admission-retries": Case(
        "poisson:rate=10", "uniform:64-512", "uniform:32-256", duration_s=60, ttft_slo="3s", retries=2
    ),
}


def add_bench_simulator_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "simulator", help="kvstorm simulate against the real engine: same loads, same seeds, one table"
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="kvstorm serve's engine options")
    parser.add_argument("--profile", default=None, help="a fitted profile (default: fit one first, same options)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--real-runs",
        type=int,
        default=2,
        help="real runs of each case (a fresh server each): how far the real engine moves between runs of the same "
        "seeded load decides which differences a simulator could be held to",
    )
    parser.add_argument("--results-dir", type=Path, default=Path("bench-results"))


@dataclass(frozen=True)
class Side:
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    output_tokens_per_s: float
    preemptions: int
    # Requests that ended ok (the others, in these cases: refused by admission).
    num_ok: int

    @classmethod
    def of(cls, result: RunResult, preemptions: int) -> Side:
        s = result.summary
        return cls(
            s.ttft.p50 if s.ttft else None,
            s.ttft.p99 if s.ttft else None,
            s.tpot.p50 if s.tpot else None,
            s.output_token_throughput,
            preemptions,
            s.outcomes[Outcome.OK],
        )


def run_bench_simulator(args: argparse.Namespace) -> BenchReport:
    names = args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; cases: {', '.join(CASES)}")
    if not 1 <= args.real_runs <= 5:
        raise ValueError(f"--real-runs must be 1 to 5, not {args.real_runs}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    profile_path = args.profile or str(_fit_profile(args.server_args, args.results_dir / "profile.json"))
    profile = load_profile(profile_path)
    chat_tokens = _served_chat_tokens(args.server_args)
    rows, failures = [], []
    for name in names:
        case = CASES[name]
        config = _config(case, args.seed)
        reals = [_run_real(case, config, args.server_args) for _ in range(args.real_runs)]
        real = reals[0][0]
        engine = simulated_engine(profile, num_kv_blocks=case.num_kv_blocks)
        # The real run's load, the server's model name included.
        simulated_config = real.config.model_copy(update={"base_url": f"simulated ({profile_path})"})
        faults = [(case.fault, [0])] if case.fault else []
        admission = AdmissionLimits(ttft_slo_s=None if case.ttft_slo is None else parse_duration(case.ttft_slo))
        simulated = simulate(
            simulated_config, engine, profile.name, faults, chat_tokens=chat_tokens, admission=admission
        )
        side = simulated.engine_side
        rows.append(
            (
                name,
                [Side.of(result, preemptions) for result, preemptions in reals],
                Side.of(simulated.result, sum(side.preemptions.values())),
                paired_ttft_ratio(real, simulated.result),
            )
        )
        for number, (result, _) in enumerate(reals, 1):
            result.write(args.results_dir / f"simulator-{name}-real-{number}.json")
            refused = [r for r in result.records if r.http_status == 429] if case.ttft_slo else []
            if result.summary.outcomes[Outcome.OK] + len(refused) != len(result.records):
                failures.append(
                    f"{name}: real run {number} had requests that did not end ok (nor refused by admission)"
                )
        simulated.result.write(args.results_dir / f"simulator-{name}-simulated.json")
    return BenchReport(_markdown(args, profile, rows), failures=failures)


def _served_chat_tokens(server_args: str) -> ChatTokens | None:
    """The served model's tokenizer, to count a multi-turn case's chat as the server does (None: a model of random
    weights has none)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    source = resolve_model(parser.parse_known_args(shlex.split(server_args))[0].model)
    return None if source.path is None else TemplateTokens(source.path)


def _fit_profile(server_args: str, path: Path) -> Path:
    command = f"kvstorm simulate profile --server-args {shlex.quote(server_args)} --out {path}"
    write_text_atomic(path, fitted_profile(shlex.split(server_args), command).model_dump_json(indent=1))
    return path


def _config(case: Case, seed: int) -> RunConfig:
    config = open_loop_load(
        "",
        "",  # the server's: both are filled in when it is up
        case.arrival,
        case.input_len,
        case.output_len,
        num_requests=case.num_requests,
        duration_s=case.duration_s,
        seed=seed,
        workload=case.workload,
    )
    return config.model_copy(update={"retries": case.retries})


def _run_real(case: Case, config: RunConfig, server_args: str) -> tuple[RunResult, int]:
    serve_args = shlex.split(server_args)
    if case.num_kv_blocks is not None:
        serve_args += ["--num-kv-blocks", str(case.num_kv_blocks)]
    if case.ttft_slo is not None:
        serve_args += ["--ttft-slo", case.ttft_slo]
    token = secrets.token_urlsafe(16)
    with kvstorm_server(serve_args, env={**os.environ, ADMIN_TOKEN_ENV: token}) as server:
        before = scrape(server.url)
        served = config.model_copy(update={"base_url": server.url, "model": served_model(server.url)})
        result = run_event_loop(_load_with_fault(served, case, token))
        after = scrape(server.url)
    return result, EngineActivity.between(before, after).preemptions


async def _load_with_fault(config: RunConfig, case: Case, token: str) -> RunResult:
    load = asyncio.create_task(run_benchmark(config, show_progress=False))
    window = case.fault
    if window is None:
        return await load
    admin = EngineAdmin(config.base_url, token)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await asyncio.sleep(window.start_s)
        await asyncio.to_thread(admin.set_faults, window.changes, 2 * (window.end_s - window.start_s))
        await asyncio.sleep(max(0.0, window.end_s - (loop.time() - started)))
    finally:  # cleared whatever happened, as a rollback would (the lease clears it too, if this process dies)
        await asyncio.to_thread(admin.clear_faults)
    result = await load
    return result.model_copy(
        update={
            "fault_windows": [
                ReportedWindow(
                    name=window.name,
                    start_unix=result.start_unix + window.start_s,
                    end_unix=result.start_unix + window.end_s,
                )
            ]
        }
    )


METRICS = {
    "ok": lambda side: side.num_ok,
    "TTFT p50": lambda side: side.ttft_p50_s,
    "TTFT p99": lambda side: side.ttft_p99_s,
    "TPOT p50": lambda side: side.tpot_p50_s,
    "throughput": lambda side: side.output_tokens_per_s,
    "preemptions": lambda side: side.preemptions,
}


@dataclass(frozen=True)
class Comparison:
    """One metric of one case: the simulated value over the mean of the real runs (``ratio``) and over the real run
    nearest to it, and how far the real runs are apart (largest over smallest, minus one; 0 for a single run)."""

    metric: str
    ratio: float | None
    nearest_run_ratio: float | None
    real_spread: float | None

    @property
    def bound(self) -> float:
        return PREEMPTION_BOUND if self.metric == "preemptions" else LATENCY_BOUND

    @property
    def verdict(self) -> str:
        """within (of the mean); undecided: not of the mean, but of one real run, and the real runs are farther apart
        than the bound themselves; else outside."""
        if self.ratio is not None and abs(self.ratio - 1) <= self.bound:
            return "within"
        if (
            self.real_spread is not None
            and self.real_spread > self.bound
            and abs(self.nearest_run_ratio - 1) <= self.bound
        ):
            return "undecided"
        return "outside"


def compare(metric: str, reals: list[Side], simulated: Side) -> Comparison:
    values = [METRICS[metric](side) for side in reals]
    simulated_value = METRICS[metric](simulated)
    if any(value is None for value in values) or simulated_value is None:
        return Comparison(metric, None, None, None)

    def ratio(real: float) -> float | None:
        if metric == "preemptions":  # counts: one preemption in a case of none is no infinite error
            return 1 + (simulated_value - real) / max(real, 1)
        return simulated_value / real if real else None

    mean = sum(values) / len(values)
    spread = max(values) / min(values) - 1 if min(values) > 0 else (0.0 if max(values) == 0 else None)
    run_ratios = [r for r in map(ratio, values) if r is not None]
    nearest = min(run_ratios, key=lambda r: abs(r - 1), default=None)
    return Comparison(metric, ratio(mean), nearest, spread)


def paired_ttft_ratio(real: RunResult, simulated: RunResult) -> float | None:
    """The median over requests of simulated / real TTFT, each request with itself (same seed: same requests). A
    percentile of a distribution with two modes (short and long prompts) moves a lot for a small shift where it
    falls between them; the paired ratio shows how far each request's prediction is off."""
    real_ttft = {r.index: r.ttft_s for r in real.records if r.outcome is Outcome.OK}
    ratios = sorted(
        r.ttft_s / real_ttft[r.index]
        for r in simulated.records
        if r.outcome is Outcome.OK and real_ttft.get(r.index) and r.ttft_s is not None
    )
    return ratios[len(ratios) // 2] if ratios else None


def _markdown(args: argparse.Namespace, profile, rows: list[tuple[str, list[Side], Side, float | None]]) -> str:
    real_runs = f"{args.real_runs} real runs of each, a fresh server each" if args.real_runs > 1 else "one real run"
    lines = [
        f"Profile: {profile.name} ({profile.fit.num_steps} steps fitted, median relative error "
        f"{profile.fit.median_relative_error:.1%}); real server: `kvstorm serve {args.server_args}`, on {cpu_name()} "
        f"({cpu_kind()}), {os.cpu_count()} CPUs. Each case: the same seeded load (`kvstorm bench serve` / "
        f"`kvstorm simulate run`), exact output lengths; {real_runs}.",
        "",
        "| case | | ok | TTFT p50 s | TTFT p99 s | TPOT p50 ms | output tok/s | preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name, reals, simulated, paired in rows:
        labelled = [(f"real {number}" if len(reals) > 1 else "real", side) for number, side in enumerate(reals, 1)]
        for label, side in (*labelled, ("simulated", simulated)):
            lines.append(
                f"| {name} | {label} | {side.num_ok} | {_cell(side.ttft_p50_s)} | {_cell(side.ttft_p99_s)} | "
                f"{_cell(side.tpot_p50_s, 1e3)} | {side.output_tokens_per_s:.1f} | {side.preemptions} |"
            )
        comparisons = [compare(metric, reals, simulated) for metric in METRICS]
        ratio_text = ", ".join(
            f"{c.metric} {c.ratio:.2f}x" if c.ratio is not None else f"{c.metric} -" for c in comparisons
        )
        outside = [c.metric for c in comparisons if c.verdict == "outside"]
        undecided = [c for c in comparisons if c.verdict == "undecided"]
        parts = ["**outside** on " + ", ".join(outside)] if outside else []
        parts += [
            "undecided on " + ", ".join(f"{c.metric} (the real runs are {c.real_spread:.0%} apart)" for c in undecided)
        ] if undecided else []  # fmt: skip
        verdict = "; ".join(parts) or "within bounds"
        spreads = [c for c in comparisons if c.real_spread]
        spread_text = (
            " Real run to run: " + ", ".join(f"{c.metric} {c.real_spread:.0%}" for c in spreads) + "."
            if spreads
            else ""
        )
        case = CASES[name]
        setting = [f"both with `--ttft-slo {case.ttft_slo}`"] if case.ttft_slo else []
        setting += [f"clients with `--retries {case.retries}`"] if case.retries else []
        objective = f" ({', '.join(setting)})" if setting else ""
        against = "the mean of the real runs" if len(reals) > 1 else "real"
        paired_text = "-" if paired is None else f"{paired:.2f}x"
        verdicts.append(
            f"- {name}{objective}: simulated / {against}: {ratio_text}: {verdict}.{spread_text} Request by request "
            f"(against real run 1), the median TTFT ratio is {paired_text}."
        )
    return "\n".join(
        [
            *lines,
            "",
            f"Bounds: requests ok, latency percentiles and throughput within {LATENCY_BOUND:.0%}, preemptions within "
            f"{PREEMPTION_BOUND:.0%} (of the mean of the real runs, at least one). Undecided: outside the bound of "
            "that mean but inside it of one real run, on a metric where the real runs of the same seeded load are "
            "farther apart than the bound: one run cannot tell there whether the simulator or the real run is off.",
            *verdicts,
        ]
    )


def _cell(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.3g}"
