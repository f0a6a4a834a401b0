"""`kvstorm bench offline`: the w1-throughput workload on kvstorm and on transformers, in one run.

Each system runs in its own child process (so peak RSS is its own); the parent
measures this CPU's float32 matmul rate (the roofline: the faster of torch.mm and the
prepacked oneDNN matmul the engine uses) and counts the FLOPs the
workload needs.

The workload is w1-throughput (``kvstorm.bench.w1``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.model.config import ModelConfig
from engine.model.packed_linear import PackedLinear, packing_applies, set_batch_invariant, tile_matmul_name
from kernels.cpu_matmul import tile_matmul_applies
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.process import run_child
from kvstorm.bench.w1 import Workload, count_flops, w1_throughput
from kvstorm.engine_commands import add_engine_arguments, engine_options_from_args, parse_bytes

PEER_MODEL = "smollm2-135m"  # the transformers peers load this GGUF


def measure_matmul_gflops(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """Best GFLOP/s of a square matmul in the engine's dtype on its device (torch's current thread count on CPU),
    per way of multiplying: ``torch.mm``, oneDNN with a prepacked weight and kvstorm's tile matmuls where the
    engine may use them."""
    size = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    paths = {"torch.mm": functools.partial(torch.mm, a, b.T)}
    if packing_applies(device, dtype):
        packed = PackedLinear(b, kernel="onednn")
        set_batch_invariant(packed, False)  # the roofline is one call, whatever slices the engine's rows take
        paths["onednn-packed"] = functools.partial(packed, a)
    if device.type == "cpu" and tile_matmul_applies(size, size, dtype):
        paths[tile_matmul_name()] = functools.partial(PackedLinear(b), a)
    return {name: 2 * size**3 / _best_seconds(multiply, device, repeats) / 1e9 for name, multiply in paths.items()}


def _best_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    work()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


# ---- systems (each runs in a child process) ------------------------------------------------------


def run_kvstorm(workload: Workload, options: dict) -> dict:
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLM

    engine = LLM(**options).engine
    start = time.perf_counter()
    for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    peak_running = peak_used_blocks = 0
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step().outputs)
        stats = engine.stats()
        peak_running = max(peak_running, stats.num_running)
        peak_used_blocks = max(peak_used_blocks, stats.num_used_device_blocks)
    elapsed = time.perf_counter() - start
    info, stats = engine.info, engine.stats()
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "peak_running": peak_running,
        "peak_used_blocks": peak_used_blocks,
        "num_device_blocks": stats.num_device_blocks,
        "block_size": info.block_size,
        "kv_cache_memory": stats.num_device_blocks * info.bytes_per_block,  # also when sized in blocks
        "bytes_per_block": info.bytes_per_block,
        "num_preemptions": stats.num_preemptions,
        "attention_backend": info.attention_backend,
        "matmul": info.matmul,
        "layer_ops": info.layer_ops,
        "device": info.device,
        "dtype": info.dtype,
    }


def _load_transformers_model():
    from transformers import AutoModelForCausalLM

    from engine.model.registry import resolve_model

    path = resolve_model(PEER_MODEL).path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def run_transformers_static(workload: Workload, batch_size: int) -> dict:
    """Left-padded batches in arrival order; each batch runs until its longest request is done."""
    model = _load_transformers_model()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        max_new = max(workload.output_lens[first : first + batch_size])
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
    # Only the tokens each request asked for count as output; the rest of its batch's tail is waste.
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": workload.num_output_tokens}


def run_transformers_continuous(workload: Workload) -> dict:
    """transformers' own continuous batching (paged attention), per-request output lengths."""
    from transformers import GenerationConfig

    model = _load_transformers_model()
    config = GenerationConfig(
        max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    start = time.perf_counter()
    for i, (prompt, output_len) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=output_len)
    produced, finished = 0, 0
    while finished < len(workload.prompts):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            finished += 1
            produced += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return {"elapsed_s": elapsed, "output_tokens": produced}


# ---- orchestration -------------------------------------------------------------------------------


@dataclass
class SystemResult:
    system: str
    elapsed_s: float | None
    output_tokens: int
    peak_rss_mib: float
    details: dict
    error: str | None = None

    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0


def system_names(static_batch_sizes: list[int], include_continuous: bool) -> list[str]:
    """kvstorm runs first and, when peers run, again last: the machine's speed drifts over a long run."""
    peers = [f"transformers-static-{size}" for size in static_batch_sizes]
    peers += ["transformers-continuous"] if include_continuous else []
    return ["kvstorm", *peers, "kvstorm"] if peers else ["kvstorm"]


def run_system_in_child(name: str, num_requests: int, kvstorm_options: dict, timeout_s: float) -> SystemResult:
    with tempfile.TemporaryDirectory() as scratch:
        result_file = Path(scratch) / "result.json"
        command = [sys.executable, "-m", "kvstorm.bench.offline", name, str(num_requests), json.dumps(kvstorm_options)]
        run = run_child([*command, str(result_file)], timeout_s)
        if result_file.exists():
            data = json.loads(result_file.read_text())
            elapsed, tokens = data.pop("elapsed_s"), data.pop("output_tokens")
            return SystemResult(name, elapsed, tokens, run.peak_rss_mib, data)
    reason = "timed out" if run.exit_code is None else f"exit status {run.exit_code}"
    return SystemResult(name, None, 0, run.peak_rss_mib, {}, error=f"{reason}: {run.output[-2000:]}")


def child_main(name: str, num_requests: int, kvstorm_options: dict, result_file: Path) -> None:
    from engine.model.registry import resolve_model

    workload = w1_throughput(num_requests, resolve_model(kvstorm_options["model"]).load_config().vocab_size)
    if name == "kvstorm":
        result = run_kvstorm(workload, kvstorm_options)
    elif name.startswith("transformers-static-"):
        result = run_transformers_static(workload, int(name.rsplit("-", 1)[1]))
    elif name == "transformers-continuous":
        result = run_transformers_continuous(workload)
    else:
        raise ValueError(f"unknown system {name!r}")
    result_file.write_text(json.dumps(result))


def run_offline_bench(
    num_requests: int,
    kvstorm_options: dict,
    static_batch_sizes: list[int],
    include_continuous: bool,
    timeout_s: float,
) -> BenchReport:
    from engine.model.registry import resolve_device, resolve_dtype, resolve_model

    config = resolve_model(kvstorm_options["model"]).load_config()
    workload = w1_throughput(num_requests, config.vocab_size)
    flops = count_flops(config, workload)
    device = resolve_device(kvstorm_options["device"])
    dtype = resolve_dtype(kvstorm_options["dtype"], device)
    matmul_gflops = measure_matmul_gflops(device, dtype)
    results = []
    for name in system_names(static_batch_sizes, include_continuous):
        print(f"[bench offline] running {name} ...", file=sys.stderr, flush=True)
        results.append(run_system_in_child(name, num_requests, kvstorm_options, timeout_s))
        print(f"[bench offline] {name}: {results[-1].elapsed_s} s", file=sys.stderr, flush=True)
    # Measured again at the end, the faster of the two counts: a momentary slowdown of this (virtual) machine
    # during one measurement must not pass for the roofline and flatter the fraction.
    again = measure_matmul_gflops(device, dtype)
    matmul_gflops = {path: max(rate, again[path]) for path, rate in matmul_gflops.items()}
    data = {
        "workload": "w1-throughput",
        "model": kvstorm_options["model"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()} CPU cores",
        "dtype": str(dtype).removeprefix("torch."),
        "num_requests": num_requests,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "matmul_gflops": matmul_gflops,
        "flops": asdict(flops),
        "threads": torch.get_num_threads(),
        "results": [asdict(r) for r in results],
    }
    failures = [r.system for r in results if r.elapsed_s is None]
    return BenchReport(render_markdown(data, results, config), data, failures)


def render_markdown(data: dict, results: list[SystemResult], config: ModelConfig) -> str:
    total_tokens = data["prompt_tokens"] + data["output_tokens"]
    # Speed-ups use the slower kvstorm run, so drift never flatters kvstorm.
    kvstorm = max(
        (r for r in results if r.system == "kvstorm" and r.elapsed_s), key=lambda r: r.elapsed_s, default=results[0]
    )
    rows = []
    for r in results:
        if r.elapsed_s is None:
            rows.append(f"| {r.system} | failed: {r.error.splitlines()[0] if r.error else '?'} | | | | |")
            continue
        speedup = kvstorm.output_tokens_per_s() / r.output_tokens_per_s() if r.output_tokens_per_s() else 0
        rows.append(
            f"| {r.system} | {r.elapsed_s:.1f} | {r.output_tokens_per_s():.1f} | {total_tokens / r.elapsed_s:.1f} "
            f"| {r.peak_rss_mib:.0f} | {speedup:.2f}x |"
        )
    lines = [
        f"Workload w1-throughput: {data['num_requests']} requests, {data['prompt_tokens']} prompt + "
        f"{data['output_tokens']} output tokens, greedy, ignore_eos, all submitted at once; kvstorm in "
        f"{data['dtype']}, transformers in float32, on {data['device']} ({data['threads']} torch threads), model "
        f"{data['model']}. kvstorm runs first and last (the machine's speed drifts); speed-ups and the roofline "
        "fraction use the slower kvstorm run. kvstorm's peak RSS includes its preallocated KV pool.",
        "",
        "| system | wall s | output tok/s | total tok/s | peak RSS MiB | kvstorm speed-up (output tok/s) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    if kvstorm.elapsed_s:
        flops, rates = data["flops"], data["matmul_gflops"]
        fastest = max(rates, key=rates.get)
        roofline = rates[fastest]
        nominal_rate = flops["nominal"] / kvstorm.elapsed_s / 1e9
        required_rate = flops["required"] / kvstorm.elapsed_s / 1e9
        d = kvstorm.details
        budget_tokens = d["num_device_blocks"] * d["block_size"]
        contiguous = budget_tokens // config.max_position_embeddings
        lines += [
            "",
            f"Roofline: the fastest square {data['dtype']} matmul here runs at **{roofline:.1f} GFLOP/s** "
            f"({fastest}; {', '.join(f'{p} {r:.1f}' for p, r in rates.items())}; same run, same threads; kvstorm's "
            f"linear layers use {d['matmul']}). "
            f"The workload needs {flops['nominal'] / 1e12:.2f} TFLOP counted the usual way (2 x parameters per "
            f"prompt and output token, plus {flops['attention'] / 1e12:.2f} TFLOP of attention); kvstorm's wall time "
            f"gives **{nominal_rate:.1f} GFLOP/s = {100 * nominal_rate / roofline:.0f}% of the roofline**. "
            f"Counting only what must really run ({flops['required'] / 1e12:.2f} TFLOP: no LM head on prompt "
            f"positions whose logits are never sampled), it is {required_rate:.1f} GFLOP/s = "
            f"{100 * required_rate / roofline:.0f}%.",
            "",
            f"KV capacity: with a {d['kv_cache_memory'] / 2**30:.1f} GiB KV budget ({d['num_device_blocks']} blocks "
            f"of {d['block_size']} tokens = {budget_tokens} token slots), kvstorm ran up to **{d['peak_running']} "
            f"requests at once** (peak {d['peak_used_blocks'] * d['block_size']} slots in use, "
            f"{d['num_preemptions']} preemptions); reserving the model's full context "
            f"({config.max_position_embeddings} tokens) contiguously per request would allow **{contiguous}**.",
        ]
    return "\n".join(lines)


# ---- the command line ----------------------------------------------------------------------------


def add_bench_offline_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "offline", help="w1-throughput: kvstorm vs transformers static and continuous batching, one run"
    )
    add_engine_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--static-batch-sizes", default="8,16,32", help="transformers static batch sizes ('' for none)")
    parser.add_argument(
        "--no-continuous", action="store_true", help="skip transformers' continuous batching (the slowest peer)"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per system before it is killed")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    parser.set_defaults(kv_cache_memory=parse_bytes("4GiB"), swap_space=0)


def run_bench_offline(args: argparse.Namespace) -> BenchReport:
    static_batch_sizes = [int(size) for size in args.static_batch_sizes.split(",") if size]
    if args.model != PEER_MODEL and (static_batch_sizes or not args.no_continuous):
        raise ValueError(
            f"the transformers peers run {PEER_MODEL} only; with --model {args.model} pass "
            "--static-batch-sizes '' --no-continuous"
        )
    options = engine_options_from_args(args)
    report = run_offline_bench(
        num_requests=args.num_requests,
        kvstorm_options=options,
        static_batch_sizes=static_batch_sizes,
        include_continuous=not args.no_continuous,
        timeout_s=args.timeout,
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report.data, indent=2))
    return report


if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4]))
