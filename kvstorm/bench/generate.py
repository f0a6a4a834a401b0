"""``kvstorm bench generate``: load time, decode speed and peak RSS of `kvstorm generate`, next to transformers
doing the same job.

Each run is a fresh process (cold Python, warm page cache after the first run);
peak RSS is the child's ru_maxrss from wait4.

    kvstorm bench generate [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from engine.model.gguf_cache import CACHE_DIR_ENV
from engine.model.registry import describe_dtype_choice, resolve_dtype
from kvstorm.bench.child import measure_in_child
from kvstorm.bench.doc import BenchReport
from kvstorm.bench.process import run_child

PROMPT = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 64
KVSTORM_STATS = re.compile(
    r"model loaded in (?P<model>[\d.]+) s, tokenizer in (?P<tokenizer>[\d.]+) s, (engine ready in [\d.]+ s, )?"
    r"(?P<prompt>\d+) prompt \+ (?P<generated>\d+) generated tokens in (?P<generate>[\d.]+) s"
)


@dataclass(frozen=True)
class Timings:
    """What a generation program reports of itself."""

    model_load_s: float
    tokenizer_load_s: float
    generated: int
    generate_s: float


def transformers_generate() -> Timings:
    """In a child process (``kvstorm.bench.child``), the peer: transformers loading the same GGUF and generating
    greedily with its KV cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.registry import resolve_model

    path = resolve_model("smollm2-135m").path
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model_s = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer_s = time.perf_counter() - start
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    return Timings(model_s, tokenizer_s, out.shape[1] - ids.shape[1], time.perf_counter() - start)


@dataclass(frozen=True)
class Run:
    """One process, measured from outside and by itself."""

    wall_s: float
    peak_rss_mib: float
    timings: Timings


def measure_kvstorm() -> Run:
    """``kvstorm generate`` as a user runs it, its timings from the line it prints."""
    command = [sys.executable, "-m", "kvstorm", "generate", "--chat", "--prompt", PROMPT]
    run = run_child([*command, "--max-tokens", str(MAX_TOKENS)])
    stats = KVSTORM_STATS.search(run.output) if run.exit_code == 0 else None
    if stats is None:
        raise RuntimeError(f"kvstorm generate failed or printed no stats line:\n{run.output[-3000:]}")
    timings = Timings(
        float(stats["model"]), float(stats["tokenizer"]), int(stats["generated"]), float(stats["generate"])
    )
    return Run(run.wall_s, run.peak_rss_mib, timings)


def measure_transformers() -> Run:
    timings, run = measure_in_child(transformers_generate, Timings)
    return Run(run.wall_s, run.peak_rss_mib, timings)


def median_row(name: str, runs: list[Run]) -> str:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    tokens_per_s = med([r.timings.generated / r.timings.generate_s for r in runs])
    model_s, tokenizer_s = med([r.timings.model_load_s for r in runs]), med([r.timings.tokenizer_load_s for r in runs])
    return (
        f"| {name} | {model_s:.2f} | {tokenizer_s:.2f} | "
        f"{med([r.wall_s for r in runs]):.2f} | {tokens_per_s:.1f} | {med([r.peak_rss_mib for r in runs]):.0f} |"
    )


def add_bench_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="load time, decode speed and peak RSS of kvstorm generate")
    parser.add_argument("--runs", type=int, default=3)


def run_bench_generate(args: argparse.Namespace) -> BenchReport:
    previous_cache = os.environ.get(CACHE_DIR_ENV)
    try:
        with tempfile.TemporaryDirectory(prefix="kvstorm-bench-cache-") as cache:
            os.environ[CACHE_DIR_ENV] = cache  # the children's: kvstorm's first run converts the GGUF into it
            measure_transformers()  # warm the page cache so every measured run reads the file from memory
            first_run = measure_kvstorm()
            kvstorm_runs = [measure_kvstorm() for _ in range(args.runs)]
            peer_runs = [measure_transformers() for _ in range(args.runs)]
    finally:
        if previous_cache is None:
            os.environ.pop(CACHE_DIR_ENV, None)
        else:
            os.environ[CACHE_DIR_ENV] = previous_cache
    table = "\n".join(
        [
            "| program | model load s | tokenizer load s | whole process s | decode tokens/s | peak RSS MiB |",
            "|---|---|---|---|---|---|",
            median_row("`kvstorm generate`, first run (converts the GGUF into the cache)", [first_run]),
            median_row("`kvstorm generate`", kvstorm_runs),
            median_row("transformers (same GGUF, `generate`)", peer_runs),
        ]
    )
    markdown = f"""`kvstorm generate`, load time and peak memory: SmolLM2-135M-Instruct (GGUF Q4_1), kvstorm with its
default `--dtype auto` ({_auto_dtype()}), transformers in float32; greedy,
chat prompt "{PROMPT}", up to {MAX_TOKENS} new tokens (stops at EOS). Medians of {args.runs} fresh processes after
one warm-up run; peak RSS is the process's `ru_maxrss`. kvstorm's first run converts the GGUF
into an empty cache directory (`engine/model/gguf_cache.py`), the others read the converted directory. Machine:
{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads.

{table}"""
    return BenchReport(markdown)


def _auto_dtype() -> str:
    cpu = torch.device("cpu")
    dtype = str(resolve_dtype("auto", cpu)).removeprefix("torch.")
    return f"{dtype} here, {describe_dtype_choice('auto', cpu)}"
