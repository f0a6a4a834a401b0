"""``kvstorm bench soak``: a kvstorm server under a mixed load with faults for a stated time, watched for what a long
run leaks.

A fresh ``kvstorm serve`` (the bundled model) takes an open-loop load for ``--duration``: a steady Poisson rate with
a burst at the start of every cycle (``onoff``), and in every cycle the faults a production server meets: a KV cap
over the burst (every other cycle: half the pool taken away, as a co-tenant taking VRAM), a client disconnect storm
aimed at a phase of the requests' lives, and a hostile client beside the load (idle sockets, slow headers, requests
reset during their submission, bad inputs: ``chaos.injectors.hostile_clients``). Every ``--sample-every`` the server
process's resident memory, open files and threads are read from ``/proc``, and its queues and KV blocks from
``/metrics``, beside the load's outcomes so far. After the load, the faults are cleared and the server must settle.

It fails (exit 1, nothing recorded) on any of: resident memory grown by more than ``MAX_RSS_GROWTH_MB`` from the
first fifth of the samples after ``--warmup`` to the last fifth; threads in the last fifth more than
``MAX_THREAD_GROWTH`` above the most of the warm-up (which holds at least a whole cycle); open files at the end above
the idle server's; requests or KV blocks still held once settled; a request of the load lost (a broken
stream or a timeout; a refusal is an answer); a run cut short; a 5xx to the hostile client's faults. A run too short
to have two windows after its warm-up is not judged fine: it fails as unmeasured.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import statistics
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from chaos.injectors.disconnects import TOKEN_PHASES, disconnect_storm
from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV, EngineAdmin
from chaos.injectors.hostile_clients import hostile_round
from chaos.injectors.processes import kvstorm_server
from chaos.run.metrics import KVOccupancy, scrape, wait_until_settled
from kernels.cpu_isa import cpu_kind
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import cpu_name
from kvstorm.bench.serve import duration_arg
from kvstorm.simulate.measure import served_model
from loadgen.benchmark import run_benchmark
from loadgen.counters import RunCounters
from loadgen.records import Outcome
from loadgen.results import RunConfig, RunResult, write_text_atomic
from loadgen.runner import RunCutShort, run_event_loop

# Growth of the server's resident memory after the warm-up that counts as a leak (the allocator's and the
# tokenizer's caches move by a few MB under a steady load).
MAX_RSS_GROWTH_MB = 64
# Threads the server may start after the warm-up without a leak: the default thread pool (asyncio's run_in_executor
# and to_thread: tokenizing, shutdown) grows lazily, as concurrency asks, to min(32, CPUs + 4) threads.
MAX_THREAD_GROWTH = min(32, (os.cpu_count() or 1) + 4)
# Open files the server may hold at the end beyond what it held idle (kept-alive sockets closing late).
MAX_OPEN_FILES_GROWTH = 8
SETTLE_TIMEOUT_S = 120.0
# Where each fault sits in a cycle, as fractions of it: the KV cap over the burst, then a storm, then the hostile
# client (for at most MAX_HOSTILE_S).
KV_CAP_END, STORM_AT, HOSTILE_AT, HOSTILE_FOR = 0.25, 0.33, 0.5, 0.25
MAX_HOSTILE_S = 20.0
# Phases a storm is aimed at in turn ("swapped" needs requests in the host pool at that instant, which the load does
# not promise; the KV cap makes them happen, and the end-of-run settle checks they were let go).
STORM_PHASES = ("queued", "prefill", *TOKEN_PHASES)
DEFAULT_SERVER_ARGS = "--num-kv-blocks 160 --swap-space 256MiB"


def add_bench_soak_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "soak",
        help="a kvstorm server under a mixed load with faults for a stated time, watched for leaks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=duration_arg, default=1800.0, help="how long the load runs (30m)")
    parser.add_argument("--warmup", type=duration_arg, default=300.0, help="samples before this are not judged")
    parser.add_argument("--cycle", type=duration_arg, default=120.0, help="a burst and each fault once per cycle")
    parser.add_argument("--sample-every", type=duration_arg, default=10.0, help="how often the server is read")
    parser.add_argument("--rate", type=float, default=1.0, help="the steady load's requests/s")
    parser.add_argument("--burst-rate", type=float, default=8.0, help="requests/s during the 5 s burst of a cycle")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="kvstorm serve's arguments besides port")
    parser.add_argument("--results-dir", type=Path, default=Path("bench-results"), help="where the samples go")


@dataclass(frozen=True)
class SoakSample:
    """One reading: seconds since the load started; the server process; its queues and KV; the load's outcomes so
    far; the faults active (``phase``: idle before the load, load, settled after)."""

    t_s: float
    phase: str
    rss_mb: float
    open_files: int
    threads: int
    used_blocks: int
    used_host_blocks: int
    running: int
    waiting: int
    swapped: int
    ok: int
    rejected: int
    broken: int
    timed_out: int
    faults: str


def process_usage(pid: int) -> tuple[float, int, int]:
    """Resident MB, open files and threads of process ``pid``, from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss_mb = int(status["VmRSS"].split()[0]) / 1024
    return rss_mb, len(os.listdir(f"/proc/{pid}/fd")), int(status["Threads"])


class _Faults:
    """The cycle's faults, injected from a thread of their own; what is active now is ``active``."""

    def __init__(self, url: str, model: str, admin: EngineAdmin, start_ts: float, args: argparse.Namespace) -> None:
        self.url, self.model, self.admin, self.start_ts, self.args = url, model, admin, start_ts, args
        self.active = ""
        self.storms: list[dict] = []
        self.hostile = Counter()
        self.hostile_answers = Counter()
        self.num_kv_caps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def __enter__(self) -> _Faults:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.admin.clear_faults()

    @property
    def hostile_s(self) -> float:
        return min(MAX_HOSTILE_S, HOSTILE_FOR * self.args.cycle)

    def _at(self, offset_s: float) -> bool:
        """Wait until ``offset_s`` after the load's start; False when the soak is stopping or past its end."""
        delay_s = self.start_ts + offset_s - time.monotonic()
        return offset_s < self.args.duration - self.hostile_s and not self._stop.wait(max(0.0, delay_s))

    def _run(self) -> None:
        cycle = 0
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        length = self.args.cycle
        while self._at(cycle * length):
            begin = cycle * length
            if cycle % 2 == 0:
                self.active = "kv_cap 0.5"
                self.admin.set_faults({"kv_cap": {"fraction": 0.5}}, lease_s=KV_CAP_END * length + 30)
                self.num_kv_caps += 1
                if self._at(begin + KV_CAP_END * length):
                    self.admin.clear_faults()
                self.active = ""
            if self._at(begin + STORM_AT * length):
                phase = STORM_PHASES[cycle % len(STORM_PHASES)]
                self.active = f"storm {phase}"
                token = os.environ[ADMIN_TOKEN_ENV]
                report = disconnect_storm(self.url, self.model, phase, admin_token=token, settle_timeout_s=10.0)
                self.storms.append(report.to_json())
                self.active = ""
            if self._at(begin + HOSTILE_AT * length):
                self.active = "hostile client"
                report = run_event_loop(hostile_round(host, int(port), self.model, self.hostile_s, seed=cycle))
                self.hostile.update(report.attempts)
                self.hostile_answers.update(report.answers)
                self.active = ""
            cycle += 1


def run_bench_soak(args: argparse.Namespace) -> BenchReport:
    if args.warmup < args.cycle:
        raise ValueError(f"--warmup ({args.warmup:g} s) must hold at least one --cycle ({args.cycle:g} s)")
    token = secrets.token_urlsafe(16)
    os.environ[ADMIN_TOKEN_ENV] = token
    args.results_dir.mkdir(parents=True, exist_ok=True)
    with kvstorm_server(shlex.split(args.server_args), args.results_dir / "soak-server.log") as server:
        pid = server.server.process.pid
        model = served_model(server.url)
        samples = [_sample(pid, server.url, 0.0, "idle", RunCounters(), "")]
        config = _load(server.url, model, args)
        counters = RunCounters()
        outcome: dict[str, RunResult] = {}
        load = threading.Thread(target=_run_load, args=(config, counters, outcome), name="soak-load", daemon=True)
        start_ts = time.monotonic()
        load.start()
        with _Faults(server.url, model, EngineAdmin(server.url, token), start_ts, args) as faults:
            while load.is_alive():
                load.join(args.sample_every)
                samples.append(_sample(pid, server.url, time.monotonic() - start_ts, "load", counters, faults.active))
        settled_s, _ = wait_until_settled(server.url, SETTLE_TIMEOUT_S)
        samples.append(_sample(pid, server.url, time.monotonic() - start_ts, "settled", counters, ""))
    result = outcome.get("result")
    failures = judge(samples, args.warmup, result, settled_s, faults.hostile_answers)
    details = {
        "samples": [asdict(s) for s in samples],
        "storms": faults.storms,
        "hostile_attempts": dict(faults.hostile),
        "hostile_answers": dict(faults.hostile_answers),
        "kv_caps": faults.num_kv_caps,
        "settled_s": settled_s,
    }
    stem = f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    write_text_atomic(args.results_dir / f"{stem}.json", json.dumps(details, indent=1))
    if result is not None:
        result.write(args.results_dir / f"{stem}-load.json")
    markdown = _markdown(args, samples, result, faults, settled_s, failures)
    return BenchReport(markdown, data=details, failures=failures)


def _load(url: str, model: str, args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        base_url=url,
        model=model,
        arrival=f"onoff:base={args.rate:g},burst={args.burst_rate:g},burst_s=5,period_s={args.cycle:g}",
        workload="random",
        input_len="fixed:128",
        output_len="fixed:64",
        num_requests=None,
        duration_s=args.duration,
        max_concurrency=None,
        request_timeout_s=300.0,
        stall_timeout_s=60.0,
        exact_output=True,
        seed=0,
        slo=None,
    )


def _run_load(config: RunConfig, counters: RunCounters, outcome: dict[str, RunResult]) -> None:
    try:
        outcome["result"] = run_event_loop(run_benchmark(config, show_progress=False, counters=counters))
    except RunCutShort as cut:
        outcome["result"] = cut.result


def _sample(pid: int, url: str, t_s: float, phase: str, counters: RunCounters, faults: str) -> SoakSample:
    rss_mb, open_files, threads = process_usage(pid)
    occupancy = KVOccupancy.of(scrape(url))
    used = occupancy.used_blocks or {}
    finished = counters.outcomes
    return SoakSample(
        t_s=round(t_s, 1),
        phase=phase,
        rss_mb=round(rss_mb, 1),
        open_files=open_files,
        threads=threads,
        used_blocks=used.get("device", 0),
        used_host_blocks=used.get("host", 0),
        running=occupancy.running,
        waiting=occupancy.waiting,
        swapped=occupancy.swapped,
        ok=finished[Outcome.OK],
        rejected=finished[Outcome.REJECTED],
        broken=finished[Outcome.BROKEN_STREAM],
        timed_out=finished[Outcome.CLIENT_TIMEOUT],
        faults=faults,
    )


def judge(
    samples: list[SoakSample],
    warmup_s: float,
    result: RunResult | None,
    settled_s: float | None,
    hostile_answers: Counter,
) -> list[str]:
    """What the soak found wrong; empty only with evidence for every check."""
    failures = []
    loaded = [s for s in samples if s.phase == "load" and s.t_s >= warmup_s]
    window = max(3, len(loaded) // 5)
    if len(loaded) < 2 * window:
        failures.append(f"unmeasured: {len(loaded)} samples after the warm-up, fewer than two windows of {window}")
    else:
        first, last = loaded[:window], loaded[-window:]
        growth_mb = statistics.median(s.rss_mb for s in last) - statistics.median(s.rss_mb for s in first)
        if growth_mb > MAX_RSS_GROWTH_MB:
            failures.append(f"resident memory grew by {growth_mb:.0f} MB after the warm-up")
        warm = max(s.threads for s in samples if s.t_s < warmup_s or s.phase == "idle")
        thread_growth = max(s.threads for s in last) - warm
        if thread_growth > MAX_THREAD_GROWTH:
            failures.append(f"threads grew by {thread_growth} after the warm-up")
    idle, end = samples[0], samples[-1]
    if end.open_files > idle.open_files + MAX_OPEN_FILES_GROWTH:
        failures.append(f"{end.open_files} open files at the end, {idle.open_files} idle")
    if settled_s is None or end.used_blocks or end.used_host_blocks or end.running or end.waiting or end.swapped:
        failures.append(
            f"not settled: {end.running} running, {end.waiting} waiting, {end.swapped} swapped, "
            f"{end.used_blocks} device and {end.used_host_blocks} host blocks held"
        )
    if result is None:
        failures.append("the load ended without results")
    else:
        outcomes = result.summary.outcomes
        lost = outcomes[Outcome.BROKEN_STREAM] + outcomes[Outcome.CLIENT_TIMEOUT]
        if lost:
            failures.append(f"{lost} requests of the load lost ({outcomes[Outcome.BROKEN_STREAM]} broken streams, "
                            f"{outcomes[Outcome.CLIENT_TIMEOUT]} timeouts)")  # fmt: skip
        if result.cut_short is not None:
            failures.append(f"the load was cut short: {result.cut_short}")
    server_errors = sum(n for answer, n in hostile_answers.items() if answer.isdigit() and int(answer) >= 500)
    if server_errors:
        failures.append(f"{server_errors} of the hostile client's faults were answered with a 5xx")
    return failures


def _markdown(args, samples, result, faults, settled_s, failures) -> str:
    loaded = [s for s in samples if s.phase == "load" and s.t_s >= args.warmup]
    rss = [s.rss_mb for s in loaded]
    hours = (loaded[-1].t_s - loaded[0].t_s) / 3600 if len(loaded) > 1 else 0.0
    slope = f"{(rss[-1] - rss[0]) / hours:+.1f} MB/h" if hours else "unmeasured"
    outcomes = result.summary.outcomes if result is not None else Counter()
    verdict = "**HELD**: " if not failures else "**FAILED**: " + "; ".join(failures) + ". "
    lines = [
        f"A fresh `kvstorm serve {args.server_args}` under `{_load('URL', 'MODEL', args).arrival}` (prompts of 128 "
        f"tokens, 64 out) for {args.duration / 60:g} min, warm-up {args.warmup / 60:g} min; every {args.cycle:g} s "
        f"cycle: a 5 s burst, a KV cap of half the pool over it (every other cycle: {faults.num_kv_caps} in all), a "
        f"disconnect storm ({len(faults.storms)}), a hostile client for {faults.hostile_s:g} s "
        f"({sum(faults.hostile.values())} attempts: {_counts(faults.hostile)}; "
        f"answered {_counts(faults.hostile_answers)}). "
        f"{cpu_name()} ({cpu_kind()}), {os.cpu_count()} CPUs.",
        "",
        verdict + f"Load: {sum(outcomes.values())} requests, {_counts({o.value: n for o, n in outcomes.items()})}. "
        f"Resident memory after the warm-up {rss[0] if rss else 0:.0f} -> {rss[-1] if rss else 0:.0f} MB ({slope}); "
        f"threads {samples[0].threads} idle, {max((s.threads for s in samples), default=0)} at most; open files "
        f"{samples[0].open_files} idle, {samples[-1].open_files} at the end; settled "
        + ("never" if settled_s is None else f"{settled_s:.1f} s after the load")
        + f" with {samples[-1].used_blocks} KV blocks held.",
        "",
        "| t (s) | RSS MB | open files | threads | KV blocks (device / host) | running / waiting / swapped "
        "| ok / rejected / broken / timed out | fault |",
        "|---|---|---|---|---|---|---|---|",
    ]
    every = max(1, round(60 / args.sample_every))
    for index, s in enumerate(samples):
        if s.phase != "load" or index % every == 0 or index == len(samples) - 2:
            lines.append(
                f"| {s.t_s:.0f}{'' if s.phase == 'load' else f' ({s.phase})'} | {s.rss_mb:.0f} | {s.open_files} "
                f"| {s.threads} | {s.used_blocks} / {s.used_host_blocks} | {s.running} / {s.waiting} / {s.swapped} "
                f"| {s.ok} / {s.rejected} / {s.broken} / {s.timed_out} | {s.faults} |"
            )
    return "\n".join(lines)


def _counts(counts) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(counts.items())) or "none"
