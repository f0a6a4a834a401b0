"""``kvstorm bench layer-ops``: step time with RMSNorm and rotary embeddings through the compiled CPU kernels against
the model's pure-torch versions, in one process, the two interleaved run by run so that the machine's drift hits both
alike.

First each op alone, per call on a decode's row (the model's shapes: 576 wide, 9 query and 3 key heads of 64; at
prefill sizes the pure-torch ops' time swings with glibc's allocator, 0.13-2.6 ms for one 512-row rotation in
float32, so the end-to-end prefill below measures those). Then, per dtype, one offline engine on the bundled
model; per run and path: the median step of a single decode stream and of four (72 outputs each, greedy, the
first 8 steps skipped), and the wall time of prefilling 8 prompts of 300 tokens (chunked under the default token
budget). Reports the median over runs.

    kvstorm bench layer-ops [--runs 5] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from functools import partial

import torch

from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLM
from engine.model.llama import RotaryEmbedding, rms_norm, rotate_heads_
from kernels.cpu_layer_ops import rms_norm_cpu, rotate_heads_cpu_
from kvstorm.bench.doc import BenchReport

DECODE_PROMPT = "Tell me a story about a dragon. " * 3
PREFILL_PROMPTS = [list(range(100 + i, 400 + i)) for i in range(8)]


def per_call_us(work, calls: int = 2000) -> float:
    for _ in range(100):
        work()
    start = time.perf_counter()
    for _ in range(calls):
        work()
    return (time.perf_counter() - start) / calls * 1e6


def op_table(dtypes: list[str]) -> list[str]:
    table = ["| op | dtype | pure torch, µs per call | CPU kernel, µs per call |", "|---|---|---|---|"]
    for name in dtypes:
        dtype = getattr(torch, name)
        x, weight, qkv = (torch.randn(*shape).to(dtype) for shape in ((1, 576), (576,), (1, 960)))
        cos, sin = RotaryEmbedding(64, 100000.0)(torch.arange(1), dtype)
        pairs = {
            "RMSNorm": (partial(rms_norm, x, weight, 1e-5), partial(rms_norm_cpu, x, weight, 1e-5)),
            "rotary, 12 heads": (
                partial(rotate_heads_, qkv, cos, sin, 12, 64),
                partial(rotate_heads_cpu_, qkv, cos, sin, 12, 64),
            ),
        }
        for op, (reference, kernel) in pairs.items():
            table.append(f"| {op} | {name} | {per_call_us(reference):.1f} | {per_call_us(kernel):.1f} |")
            print(table[-1], flush=True)
    return table


def decode_step_ms(llm: LLM, num_streams: int) -> float:
    engine = llm.engine
    for _ in range(num_streams):
        engine.add_request(DECODE_PROMPT, SamplingParams(max_tokens=72, ignore_eos=True, temperature=0))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps[8:]) * 1e3


def prefill_ms(llm: LLM) -> float:
    start = time.perf_counter()
    llm.generate(PREFILL_PROMPTS, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    return (time.perf_counter() - start) * 1e3


def add_bench_layer_ops_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("layer-ops", help="RMSNorm and rotary embeddings: CPU kernels against torch")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtypes", default="bfloat16,float32")


def run_bench_layer_ops(args: argparse.Namespace) -> BenchReport:
    ops = op_table(args.dtypes.split(","))
    table = [
        "| dtype | norms and rotary | decode step, 1 stream, ms | decode step, 4 streams, ms "
        "| prefill 8 x 300 tokens, ms |",
        "|---|---|---|---|---|",
    ]
    for dtype in args.dtypes.split(","):
        llm = LLM(dtype=dtype, num_kv_blocks=512)
        if not llm.engine.info.layer_ops.startswith("cpu-kernels"):
            return BenchReport("", failures=[f"the CPU kernels do not run here ({dtype}): nothing to compare"])
        model = llm.engine.runner.model
        results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        prefill_ms(llm)  # warm-up: oneDNN's first calls at each shape
        for _ in range(args.runs):
            for kernels in (True, False):
                model.use_cpu_kernels(kernels)
                results[kernels].append((decode_step_ms(llm, 1), decode_step_ms(llm, 4), prefill_ms(llm)))
        for kernels in (True, False):
            medians = [statistics.median(run[i] for run in results[kernels]) for i in range(3)]
            label = llm.engine.info.layer_ops if kernels else "torch"
            line = f"| {dtype} | {label} | " + " | ".join(f"{m:.1f}" for m in medians) + " |"
            table.append(line)
    markdown = "\n".join(
        [
            "RMSNorm and rotary embeddings, compiled CPU kernels against pure torch: the bundled model, offline "
            f"engine, {platform.processor() or platform.machine()}; medians over {args.runs} interleaved runs of "
            "each path (kvstorm/bench/layer_ops.py's docstring says what a run is).",
            "",
            *ops,
            "",
            *table,
        ]
    )
    return BenchReport(markdown)
