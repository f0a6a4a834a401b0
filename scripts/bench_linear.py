"""GFLOP/s of the model's linear layers: ``F.linear`` (MKL, repacks the weight per call) against the engine's
``PackedLinear`` (oneDNN, weight prepacked once), at decode and prefill batch sizes.

Shapes are SmolLM2-135M's: the fused QKV, output, gate+up and down projections and
the LM head. Each cell is the best of a few timed calls after a warm-up, with
torch's current thread count. Writes the "linear" section of docs/benchmarks.md.

    .venv/bin/python scripts/bench_linear.py [--rows 1,16,64,128,2048]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import time

import torch
import torch.nn.functional as F

from engine.model.packed_linear import PackedLinear
from engine.model.registry import resolve_model
from kvstorm.bench.doc import update_section


def layer_shapes() -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each matmul in one pass of the bundled model."""
    c = resolve_model("smollm2-135m").load_config()
    return {
        "qkv_proj": (c.hidden_size, c.q_size + 2 * c.kv_size),
        "o_proj": (c.q_size, c.hidden_size),
        "gate_up_proj": (c.hidden_size, 2 * c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
        "lm_head": (c.hidden_size, c.vocab_size),
    }


def best_seconds(work, repeats: int) -> float:
    work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,128,2048", help="batch sizes (tokens per matmul)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    table = [
        "| layer (in x out) | rows | F.linear GFLOP/s | PackedLinear GFLOP/s | speed-up |",
        "|---|---|---|---|---|",
    ]
    for layer, (in_features, out_features) in layer_shapes().items():
        weight = torch.randn(out_features, in_features)
        packed = PackedLinear(weight)
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            flop = 2 * rows * in_features * out_features
            plain_rate = flop / best_seconds(functools.partial(F.linear, x, weight), args.repeats) / 1e9
            packed_rate = flop / best_seconds(functools.partial(packed, x), args.repeats) / 1e9
            table.append(
                f"| {layer} ({in_features} x {out_features}) | {rows} | {plain_rate:.1f} | {packed_rate:.1f} "
                f"| {packed_rate / plain_rate:.2f}x |"
            )
            print(table[-1], flush=True)
    markdown = "\n".join(
        [
            "## Linear layers: MKL `F.linear` against prepacked oneDNN (`scripts/bench_linear.py`)",
            "",
            f"float32, SmolLM2-135M's weight shapes, {torch.get_num_threads()} torch threads, "
            f"{platform.machine()}, torch {torch.__version__}. Best of {args.repeats} calls after a warm-up. The "
            "engine's CPU path is `PackedLinear` (engine/model/packed_linear.py).",
            "",
            *table,
            "",
            f"Reproduce: `.venv/bin/python scripts/bench_linear.py --rows {args.rows}` ({datetime.date.today()})",
        ]
    )
    update_section("linear", markdown)


if __name__ == "__main__":
    main()
