"""``kvstorm simulate run`` (a load through the simulated engine, to the results file and report of a real run) and
``kvstorm simulate profile`` (fit this machine's step costs from the real engine as it serves)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

from engine.core.config import PreemptionMode
from engine.core.fleet import ROUTERS
from engine.core.simulator import FaultWindow
from kvstorm.admission_options import add_admission_arguments, admission_limits
from kvstorm.bench.serve import add_retries_argument, duration_arg
from kvstorm.simulate.conversations import TemplateTokens
from kvstorm.simulate.measure import CONCURRENCY, fitted_profile
from kvstorm.simulate.profiles import PROFILES, load_profile, simulated_engine
from kvstorm.simulate.run import simulate
from loadgen.arrivals import __doc__ as ARRIVALS_DOC
from loadgen.benchmark import summary_markdown
from loadgen.report import write_report
from loadgen.results import RunConfig, write_text_atomic
from loadgen.spec import parse_duration

FAULT_HELP = """Faults (--fault, repeatable): 'START-END NAME=VALUE' sets an engine fault (the value as /admin/faults
takes it, in JSON) from START to END and clears it then, as a chaos experiment's rollback does; 'START-END kill' kills
the engine at START (every stream in it breaks, arrivals are refused) and restarts it empty at END. With --replicas,
'START-END@0-7,12 ...' hits those replicas only (every one by default). Examples:
  --fault '10s-35s kv_cap={"fraction": 0.3}'   --fault '5s-20s swap_delay_per_block=0.01'
  --fault '12s-14s fail_next_steps=5'          --fault '30s-45s kill'
  --replicas 64 --router least-outstanding --fault '20s-80s@0-7 kv_cap={"fraction": 0.3}'
"""
_FAULT = re.compile(r"\s*(?P<start>[^-\s@]+)\s*-\s*(?P<end>[^\s@]+)(@(?P<replicas>[\d,-]+))?\s+(?P<what>.+)")
# Each replica has pools of its own: 512 of an H200's 51,898 blocks is about 2 GiB.
MAX_REPLICAS = 512


def parse_fault(text: str) -> tuple[FaultWindow, tuple[int, ...] | None]:
    """A fault window and the replicas it hits (None: every one)."""
    match = _FAULT.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a fault window: {text!r} (START-END[@REPLICAS] NAME=VALUE or START-END[@REPLICAS] kill)"
        )
    try:
        start_s, end_s = parse_duration(match["start"]), parse_duration(match["end"])
        replicas = None if match["replicas"] is None else _replica_list(match["replicas"])
        what = match["what"].strip()
        if what == "kill":
            return FaultWindow("kill", start_s, end_s, None), replicas
        name, _, value = what.partition("=")
        return FaultWindow(name.strip(), start_s, end_s, {name.strip(): json.loads(value)}), replicas
    except ValueError as error:  # json.JSONDecodeError is one
        raise argparse.ArgumentTypeError(f"fault {text!r}: {error}") from None


def _replica_list(text: str) -> tuple[int, ...]:
    """'0-7,12' -> 0, 1, ..., 7, 12."""
    replicas: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or int(last or first) >= MAX_REPLICAS:
            raise ValueError(f"not a list of replicas (0-7,12): {text!r}")
        replicas.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(replicas))


def _replica_count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"not a number of replicas from 1 to {MAX_REPLICAS}: {text!r}")
    return int(text)


def _counts(text: str) -> tuple[int, ...]:
    if not all(part.isdigit() and 1 <= int(part) <= 1024 for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"not a list of batch sizes from 1 to 1024: {text!r}")
    return tuple(int(part) for part in text.split(","))


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="the engine's own scheduler in virtual time, with a step-cost profile (a prediction)"
    )
    commands = parser.add_subparsers(dest="simulate", required=True)
    run = commands.add_parser(
        "run",
        help="a load through the simulated engine: the results file and report of a real run",
        description="The load of `kvstorm bench serve` (same options, same seed: same arrivals, prompts and lengths) "
        "through the engine's own scheduler in virtual time.\n" + ARRIVALS_DOC.split("\n\n", 2)[2] + FAULT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--profile",
        required=True,
        help=f"a step-cost profile: {', '.join(PROFILES)} (roofline examples), or a file from `simulate profile`",
    )
    run.add_argument(
        "--workload",
        default="random",
        help="random[:low=,high=], shared-prefix:..., a trace's prompts, or multiturn:turns=,system_len=[,think_s=]",
    )
    run.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="multiturn: the served model's GGUF file or Hugging Face folder, to count the chat's tokens as its server "
        "does (default: estimated from the words)",
    )
    run.add_argument("--input-len", default="fixed:128", help="prompt length distribution (tokens)")
    run.add_argument("--output-len", default="fixed:128", help="output length distribution (max_tokens)")
    run.add_argument("--arrival", default="poisson:rate=4", help="arrival process (see above)")
    run.add_argument("--num-requests", type=int, default=None, help="stop scheduling after this many")
    run.add_argument("--duration", type=duration_arg, default=None, help="stop scheduling after this long (60s)")
    run.add_argument("--request-timeout", type=duration_arg, default=600.0, help="a client gives up after this long")
    add_retries_argument(run)
    run.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompts")
    run.add_argument("--slo", default=None, help="e.g. ttft_p99=2s,tpot_p99=200ms (adds goodput)")
    run.add_argument("--fault", type=parse_fault, action="append", default=[], help="a fault window (see above)")
    run.add_argument("--replicas", type=_replica_count, default=1, help="a fleet of this many engines behind --router")
    run.add_argument("--router", choices=ROUTERS, default="round-robin", help="how the fleet's router picks a replica")
    group = run.add_argument_group("the simulated engine (default: the profile's)")
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--num-swap-blocks", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--preemption-mode", choices=[m.value for m in PreemptionMode], default=None)
    group.add_argument("--no-prefix-caching", action="store_true")
    add_admission_arguments(run)
    run.add_argument("--results-dir", type=Path, default=Path("bench-results"), help="where JSON + HTML go")
    run.add_argument("--bucket", type=duration_arg, default=1.0, help="time-series bucket of the report")
    run.set_defaults(handler=run_simulate)

    profile = commands.add_parser(
        "profile",
        help="measure this machine's step costs on the real engine and fit a profile",
        description="Starts `kvstorm serve SERVER_ARGS`, sends it bursts of random prompts at growing concurrency and "
        "then Poisson arrivals, fits each busy loop iteration's time to its step's shape, and writes the profile "
        "`simulate run --profile` reads.",
    )
    profile.add_argument(
        "--server-args",
        default="",
        help="the options of the `kvstorm serve` to profile (its engine: model, dtype, KV pool, limits)",
    )
    profile.add_argument("--seed", type=int, default=0, help="seeds the measuring load")
    profile.add_argument("--out", type=Path, required=True, help="the profile file to write (JSON)")
    profile.add_argument(
        "--concurrency",
        type=_counts,
        default=CONCURRENCY,
        help=f"the batch sizes measured, in turn (default {','.join(map(str, CONCURRENCY))})",
    )
    profile.set_defaults(handler=run_profile)


def run_simulate(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    engine = simulated_engine(
        profile,
        num_kv_blocks=args.num_kv_blocks,
        num_swap_blocks=args.num_swap_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode,
        enable_prefix_caching=False if args.no_prefix_caching else None,
    )
    config = RunConfig(
        base_url=f"simulated ({args.profile})",
        model=profile.model_name,
        arrival=args.arrival,
        workload=args.workload,
        input_len=args.input_len,
        output_len=args.output_len,
        num_requests=args.num_requests,
        duration_s=args.duration,
        max_concurrency=None,
        request_timeout_s=args.request_timeout,
        stall_timeout_s=args.request_timeout,
        retries=args.retries,
        exact_output=True,
        seed=args.seed,
        slo=args.slo,
    )
    every = tuple(range(args.replicas))
    faults = [(window, every if hit is None else hit) for window, hit in args.fault]
    if args.tokenizer is not None and not args.tokenizer.exists():
        raise ValueError(f"--tokenizer {args.tokenizer}: no such file or folder")
    chat_tokens = TemplateTokens(args.tokenizer) if args.tokenizer is not None else None
    run = simulate(
        config,
        engine,
        profile.name,
        faults,
        args.bucket,
        args.replicas,
        args.router,
        chat_tokens,
        admission_limits(args),
    )
    side = run.engine_side
    stem = f"simulate-{time.strftime('%Y%m%d-%H%M%S')}-{run.result.run_id}"
    json_path, html_path = args.results_dir / f"{stem}.json", args.results_dir / f"{stem}.html"
    run.result.write(json_path)
    write_report(
        run.result, html_path, bucket_s=args.bucket, title=f"kvstorm simulate {run.result.run_id} (a prediction)"
    )
    print(
        f"Simulated: {profile.name}; {engine.num_device_blocks} KV blocks of {engine.block_size} tokens, "
        f"{engine.num_host_blocks} swap blocks."
    )
    print(summary_markdown(run.result))
    print(
        f"\nEngine side: preemptions {side.preemptions['swap']} by swap, {side.preemptions['recompute']} by recompute; "
        f"{side.num_swapped_out_blocks} blocks swapped out, {side.num_swapped_in_blocks} in; "
        f"{side.num_failed_steps} failed steps; {side.num_steps} steps in {side.end_s:.1f} s of virtual time, "
        f"simulated in {run.wall_s:.2f} s."
    )
    print(f"\nResults: `{json_path}`, report: `{html_path}`")
    return 0


def run_profile(args: argparse.Namespace) -> int:
    command = shlex.join(["kvstorm", *sys.argv[1:]])
    profile = fitted_profile(shlex.split(args.server_args), command, args.seed, args.concurrency)
    write_text_atomic(args.out, profile.model_dump_json(indent=1))
    fit, cost = profile.fit, profile.cost
    print(
        f"{profile.name}: {fit.num_steps} steps fitted; relative error median {fit.median_relative_error:.1%}, "
        f"p90 {fit.p90_relative_error:.1%}, of the total time {fit.total_relative_error:.1%}.\n"
        f"A step: {cost.per_step_s * 1e3:.2f} ms + {cost.per_prefill_token_s * 1e6:.1f} us per prompt token + "
        f"{cost.per_decode_s * 1e6:.1f} us per decode + {cost.per_context_token_s * 1e9:.1f} ns per context token + "
        f"{cost.per_attended_pair_s * 1e9:.3f} ns per attended pair; a block moved: {cost.swap_block_s * 1e6:.1f} us; "
        f"a token reaches its client {profile.token_latency_s * 1e3:.1f} ms after its step.\n"
        f"Written to {args.out}"
    )
    return 0
