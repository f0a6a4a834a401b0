"""``kvstorm bench linear``: GFLOP/s of the model's linear layers at decode and prefill batch sizes. float32:
``F.linear`` (MKL, repacks the weight per call) against the engine's ``PackedLinear`` (oneDNN, weight prepacked
once). bfloat16 on a CPU with AMX or AVX512-BF16: ``PackedLinear`` on oneDNN as the engine ran it before
(batch-invariant: rows padded and sliced as probed) against kvstorm's tile matmuls (``kernels.cpu_matmul``), which
the engine now takes there.

Shapes are SmolLM2-135M's: the fused QKV, output, gate+up and down projections and
the LM head. Each cell is the best of a few timed calls after a warm-up, with
torch's current thread count; a call's weight is one of enough copies to exceed the CPU's caches, as in a model's
pass, where each weight comes from memory. float32 and bfloat16 on each instruction set have a section each.

    kvstorm bench linear [--dtype float32|bfloat16] [--rows 1,16,64,128,2048]
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.packed_linear import TILE_LAYOUT, PackedLinear, set_batch_invariant, tile_matmul_name
from engine.model.registry import native_bfloat16_cpu_feature, resolve_model
from kernels.cpu_matmul import tile_matmul_isa
from kvstorm.bench.doc import BenchReport


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


# bfloat16 calls cycle through copies of a weight that together exceed this, so that each call reads its weight
# from memory as in a model's pass (the machine we measure on has up to 480 MiB of L3).
COLD_BYTES = 1 << 30


def float32_rows(in_features: int, out_features: int, rows_list: list[int], repeats: int) -> list[str]:
    weight = torch.randn(out_features, in_features)
    packed = PackedLinear(weight)
    lines = []
    for rows in rows_list:
        x = torch.randn(rows, in_features)
        flop = 2 * rows * in_features * out_features
        plain_rate = flop / best_seconds(functools.partial(F.linear, x, weight), repeats) / 1e9
        packed_rate = flop / best_seconds(functools.partial(packed, x), repeats) / 1e9
        lines.append(
            f"| ({in_features} x {out_features}) | {rows} | {plain_rate:.1f} | {packed_rate:.1f} "
            f"| {packed_rate / plain_rate:.2f}x |"
        )
    return lines


def call_each(layers: list[PackedLinear], x: torch.Tensor) -> None:
    for layer in layers:
        layer(x)


def bfloat16_rows(in_features: int, out_features: int, rows_list: list[int], repeats: int) -> list[str]:
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    copies = max(1, COLD_BYTES // weight.nbytes)
    layers = {kernel: [PackedLinear(weight, kernel=kernel) for _ in range(copies)] for kernel in ("onednn", "auto")}
    assert all(layer.layout == TILE_LAYOUT for layer in layers["auto"]), "this CPU has no tile matmuls"
    onednn_rows = set_batch_invariant(nn.ModuleList(layers["onednn"]), True)  # one shape: one range
    lines = []
    for rows in rows_list:
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        flop = 2 * rows * in_features * out_features * copies
        rates = {
            kernel: flop / best_seconds(functools.partial(call_each, layers[kernel], x), repeats) / 1e9
            for kernel in layers
        }
        lines.append(
            f"| ({in_features} x {out_features}) | {rows} | {onednn_rows.padded(min(rows, onednn_rows.most))} "
            f"| {rates['onednn']:.1f} | {rates['auto']:.1f} | {rates['auto'] / rates['onednn']:.2f}x |"
        )
    return lines


def add_bench_linear_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("linear", help="GFLOP/s of the model's linear layers, per engine path")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", default="1,16,64,128,2048", help="batch sizes (tokens per matmul)")
    parser.add_argument("--repeats", type=int, default=10)


def run_bench_linear(args: argparse.Namespace) -> BenchReport:
    if args.dtype == "bfloat16" and tile_matmul_isa() is None:
        return BenchReport("", failures=["bfloat16 compares kvstorm's tile matmuls, and this CPU has none"])
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.dtype == "float32":
        title = "Linear layers: MKL `F.linear` against prepacked oneDNN"
        header = "| layer (in x out) | rows | F.linear GFLOP/s | PackedLinear GFLOP/s | speed-up |"
        what = "The engine's CPU path is `PackedLinear` (engine/model/packed_linear.py)."
        measure = float32_rows
    else:
        title = f"Linear layers in bfloat16: oneDNN against {tile_matmul_name()}"
        header = (
            f"| layer (in x out) | rows | oneDNN call rows | oneDNN GFLOP/s | {tile_matmul_name()} GFLOP/s | speed-up |"
        )
        what = (
            "`PackedLinear` on oneDNN as the engine ran it before (batch layout, batch-invariant: rows padded and "
            "sliced to the probed range, 'oneDNN call rows' for the first slice) against `PackedLinear` on kvstorm's "
            f"tile matmuls (kernels/csrc/tile_matmul.cpp, {tile_matmul_name()} here), which the engine takes on a CPU "
            f"with AMX or AVX512-BF16. Each call's weight is one of enough copies to fill {COLD_BYTES >> 20} MiB, so "
            "it comes from memory as in a model's pass."
        )
        measure = bfloat16_rows
    table = [header, "|---|---|---|---|---|" + ("---|" if args.dtype == "bfloat16" else "")]
    for layer, (in_features, out_features) in layer_shapes().items():
        for line in measure(in_features, out_features, rows_list, args.repeats):
            table.append(f"| {layer} {line.removeprefix('| ')}")
    markdown = "\n".join(
        [
            f"{title}: {args.dtype}, SmolLM2-135M's weight shapes, {torch.get_num_threads()} torch threads, "
            f"{platform.machine()} ({native_bfloat16_cpu_feature() or 'no native bfloat16'}), torch "
            f"{torch.__version__}. Best of {args.repeats} calls after a warm-up. {what}",
            "",
            *table,
        ]
    )
    # bfloat16: a section per instruction set (the tile matmuls run on AMX or AVX512-BF16).
    return BenchReport(markdown, case="float32" if args.dtype == "float32" else f"bfloat16-{tile_matmul_isa()}")
