"""``kvstorm bench kernels-aot``: every Triton kernel compiled for sm_80 and sm_90 here, without a GPU, with its
registers, spills, shared memory and occupancy (``kernels.aot``), recorded in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import time

from kernels.aot import BLOCK_SIZES, DTYPES, GROUPS, HEAD_DIMS, check, grouped_table, matrix, summary
from kvstorm.bench.doc import BenchReport


def add_bench_kernels_aot_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "kernels-aot", help="compile every Triton kernel for A100 and H100 without a GPU; registers, spills, occupancy"
    )
    parser.add_argument("--quick", action="store_true", help="only the largest configuration of each kernel")


def run_bench_kernels_aot(args: argparse.Namespace) -> BenchReport:
    started = time.perf_counter()
    results = check(matrix(args.quick))
    failures = [f"{r.kernel} {r.config} {r.target.name}: {'; '.join(r.problems)}" for r in results if r.problems]
    scope = (
        f"Configurations: dtypes {', '.join(DTYPES)}; head_dim {' and '.join(map(str, HEAD_DIMS))}; block sizes "
        f"{' and '.join(map(str, BLOCK_SIZES))}; {', '.join(map(str, GROUPS))} query heads per KV head; int64 block "
        "tables and lengths as the engine builds them; decode over 256 tokens (one partition) and 2048 (split, with "
        "the merge kernel), prefill of 128 tokens, a swap's block copy. "
        "Occupancy is theoretical (registers, shared memory, warps and blocks per SM). Every configuration's row: "
        "`python -m kernels.aot`."
    )
    markdown = f"{summary(results, time.perf_counter() - started)}\n\n{scope}\n\n{grouped_table(results)}"
    return BenchReport(markdown, failures=failures)
