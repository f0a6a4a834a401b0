"""``kvstorm bench attention``: attention on the CPU, the compiled backend (``--attention-backend cpu``) against the
pure-torch reference (``--attention-backend torch``: gather + padded SDPA for decodes, SDPA per prompt for prefill),
the same inputs through each backend's ``forward`` (cache write included), interleaved run by run in one process so
that the machine's drift hits both alike. Reports the median over runs.

The model's attention shapes (9 query and 3 KV heads of 64, blocks of 16 tokens), 30 layers with a cache each:

- decode: 72 sequences of 100-700 tokens (uniform, seed 0) whose blocks are scattered over the pool, one new token
  each, through all 30 layers; the caches (30 x 2 x 22 MB in bfloat16, one tensor on huge pages as the engine
  allocates it) do not fit in any CPU cache, as in serving;
- prefill: 8 prompts of 250 tokens as one step's rows, nothing cached before, through all 30 layers.

    kvstorm bench attention [--runs 5] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from types import SimpleNamespace

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.kv_cache import PagedKVCache
from engine.attention.torch_backend import TorchAttentionBackend
from kvstorm.bench.doc import BenchReport

LAYERS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64
BACKENDS = {"torch reference": TorchAttentionBackend(), "compiled (cpu)": CpuAttentionBackend()}


class Step:
    """One step's rows over LAYERS caches: (context length, new tokens) per sequence, blocks scattered."""

    def __init__(self, shapes: list[tuple[int, int]], dtype: torch.dtype) -> None:
        num_blocks = sum(-(-seq_len // BLOCK_SIZE) for seq_len, _ in shapes) + 1
        free = random.Random(1).sample(range(1, num_blocks), num_blocks - 1)
        block_tables, slots = [], []
        for seq_len, query_len in shapes:
            blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
            block_tables.append(blocks)
            new_positions = range(seq_len - query_len, seq_len)
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new_positions]
        self.metadata = AttentionMetadata.build(
            [q for _, q in shapes], [s for s, _ in shapes], slots, block_tables, BLOCK_SIZE, torch.device("cpu")
        )
        rows = len(slots)
        # Allocated as the engine allocates its cache (one tensor, on huge pages), then filled layer by layer.
        shape = SimpleNamespace(num_layers=LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
        cache = PagedKVCache(shape, num_blocks, BLOCK_SIZE, dtype, "cpu")
        for layer in cache.data:
            layer.copy_(torch.randn(layer.shape))
        self.caches = cache.layers
        self.q = torch.randn(rows, NUM_HEADS, HEAD_DIM).to(dtype)
        self.k, self.v = (torch.randn(rows, NUM_KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))

    def run_ms(self, backend) -> float:
        start = time.perf_counter()
        for cache in self.caches:
            backend.forward(self.q, self.k, self.v, cache, self.metadata, HEAD_DIM**-0.5)
        return (time.perf_counter() - start) * 1e3


def measure(dtype: torch.dtype, runs: int) -> dict[str, dict[str, float]]:
    rng = random.Random(0)
    steps = {
        "decode, 72 sequences of 100-700 tokens": Step([(rng.randint(100, 700), 1) for _ in range(72)], dtype),
        "prefill, 8 prompts of 250 tokens": Step([(250, 250)] * 8, dtype),
    }
    times: dict[str, dict[str, list[float]]] = {step: {name: [] for name in BACKENDS} for step in steps}
    for step_name, step in steps.items():
        for backend in BACKENDS.values():
            step.run_ms(backend)  # warm-up (and the first build of the compiled kernels)
        for _ in range(runs):
            for name, backend in BACKENDS.items():
                times[step_name][name].append(step.run_ms(backend))
    return {step: {name: statistics.median(ms) for name, ms in by.items()} for step, by in times.items()}


def add_bench_attention_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("attention", help="the compiled CPU attention kernel against the torch reference")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtypes", default="bfloat16,float32")


def run_bench_attention(args: argparse.Namespace) -> BenchReport:
    table = ["| dtype | step (30 layers) | torch reference, ms | compiled, ms | speed-up |", "|---|---|---|---|---|"]
    for name in args.dtypes.split(","):
        for step, by_backend in measure(getattr(torch, name), args.runs).items():
            reference, compiled = by_backend["torch reference"], by_backend["compiled (cpu)"]
            table.append(f"| {name} | {step} | {reference:.1f} | {compiled:.1f} | {reference / compiled:.1f}x |")
    markdown = "\n".join(
        [
            "Attention on the CPU, the compiled kernel against the torch reference: each backend's `forward` (cache "
            f"write included) on the same inputs, {LAYERS} layers with a cache each, the model's shapes ({NUM_HEADS} "
            f"query and {NUM_KV_HEADS} KV heads of {HEAD_DIM}, blocks of {BLOCK_SIZE}), the caches allocated as the "
            f"engine does (on huge pages); decode blocks scattered over the pool; medians of {args.runs} interleaved "
            f"runs, {torch.get_num_threads()} torch threads, {platform.machine()}, torch {torch.__version__}.",
            "",
            *table,
        ]
    )
    return BenchReport(markdown)
