"""Every Triton kernel compiled for real GPUs on a machine without one, and its resources checked.

The interpreter that runs the kernels in the tests accepts programs a GPU compile rejects and says nothing of
registers, spills or shared memory. Here each kernel is compiled to PTX and a cubin for sm_80 (A100) and sm_90
(H100/H200) and the bundled ``ptxas`` reports its registers and spills. The launches compiled are the engine's
own: the launchers (``reshape_and_cache``, ``paged_decode_attention``, ``paged_prefill_attention``,
``copy_blocks``) run on CPU tensors of each configuration with Triton's launch recorded instead of executed, so
grid, arguments, constexprs and ``num_warps`` are exactly what they pick at run time.

    python -m kernels.aot            # the whole matrix; the table; exit 1 on a compile error, a spill, or too
                                     # much shared memory
    python -m kernels.aot --quick    # the largest configuration of each kernel
    python -m kernels.aot --dtypes bf16,fp32   # the matrix in these dtypes only (what the tests compile)
    kvstorm bench kernels-aot        # the whole matrix, recorded in docs/benchmarks.md

Needs ``TRITON_INTERPRET`` unset (compiled kernels, not interpreted ones).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kernels.triton_block_copy import copy_blocks
from kernels.triton_paged_attention import (
    DECODE_PARTITION_SIZE,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)


@dataclass(frozen=True)
class Target:
    name: str
    capability: int
    shared_per_block: int  # the most a block may opt in to, bytes
    shared_per_sm: int
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32

    @property
    def triton(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)


TARGETS = (
    Target("sm_80", 80, shared_per_block=163 * 1024, shared_per_sm=164 * 1024),
    Target("sm_90", 90, shared_per_block=227 * 1024, shared_per_sm=228 * 1024),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
GROUPS = (1, 4, 8)  # query heads per KV head: MHA, Llama-3-8B, Llama-3-70B
NUM_KV_HEADS = 8
SHORT_CONTEXT = 256  # one decode partition
LONG_CONTEXT = 2048  # DECODE_PARTITION_SIZE splits it: the split-K path and its merge kernel
PREFILL_TOKENS = 128
# Block tables, lengths, slots and offsets: int64, as engine/attention/backend.py builds them.
INDEX = torch.int64


@dataclass(frozen=True)
class Config:
    dtype: str
    head_dim: int
    block_size: int
    group: int

    def __str__(self) -> str:
        return f"{self.dtype} d{self.head_dim} bs{self.block_size} g{self.group}"


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher made it: the kernel, its arguments and options."""

    kernel: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    what: str  # the launcher and the path it took

    def source(self) -> tuple[ASTSource, dict[str, Any]]:
        """What ``triton.compile`` takes: the signature from the argument types, the constexprs, the options."""
        values = dict(zip([p.name for p in self.kernel.params], self.args, strict=False))
        options = {key: self.kwargs[key] for key in ("num_warps", "num_stages") if key in self.kwargs}
        values.update({k: v for k, v in self.kwargs.items() if k not in options})
        signature, constexprs = {}, {}
        for param in self.kernel.params:
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            else:
                signature[param.name] = _type_of(value)
        return ASTSource(fn=self.kernel, signature=signature, constexprs=constexprs), options


@dataclass(frozen=True)
class Result:
    kernel: str
    what: str
    config: str
    target: Target
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    compile_s: float
    error: str | None = None

    @property
    def occupancy(self) -> float:
        """Resident warps over the SM's maximum, from registers, shared memory, warps and blocks per SM."""
        t = self.target
        registers_per_warp = -(-self.registers * 32 // 256) * 256  # allocated per warp in units of 256
        limits = [t.max_blocks_per_sm, t.max_warps_per_sm // self.num_warps]
        if self.registers:
            limits.append(t.registers_per_sm // (registers_per_warp * self.num_warps))
        if self.shared_bytes:
            limits.append(t.shared_per_sm // self.shared_bytes)
        return min(limits) * self.num_warps / t.max_warps_per_sm

    @property
    def problems(self) -> list[str]:
        if self.error:
            return [self.error]
        found = []
        if self.spill_bytes:
            found.append(f"{self.spill_bytes} bytes spilled")
        if self.shared_bytes > self.target.shared_per_block:
            found.append(f"{self.shared_bytes} bytes of shared memory, over {self.target.shared_per_block}")
        return found


def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
                      torch.int64: "i64"}[value.dtype]  # fmt: skip
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


@contextmanager
def recorded_launches(what: str) -> Iterator[list[Launch]]:
    """Within: a kernel launch (``kernel[grid](...)``) is recorded, not run."""
    launches: list[Launch] = []
    original = JITFunction.__getitem__

    def record(kernel: JITFunction, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: launches.append(Launch(kernel, args, kwargs, what))

    JITFunction.__getitem__ = record
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = original


def launches(config: Config) -> list[Launch]:
    """The engine's launches for one configuration: cache write, decode (one partition and split), prefill, and
    the block copy of a swap."""
    dtype = DTYPES[config.dtype]
    num_heads = NUM_KV_HEADS * config.group
    blocks = LONG_CONTEXT // config.block_size + 1
    cache = torch.zeros(blocks, config.block_size, NUM_KV_HEADS, config.head_dim, dtype=dtype)
    kv = torch.zeros(PREFILL_TOKENS, NUM_KV_HEADS, config.head_dim, dtype=dtype)
    recorded: list[Launch] = []
    with recorded_launches("reshape_and_cache") as calls:
        reshape_and_cache(kv, kv, cache, cache, torch.zeros(PREFILL_TOKENS, dtype=INDEX))
    recorded += calls
    for context in (SHORT_CONTEXT, LONG_CONTEXT):
        q = torch.zeros(4, num_heads, config.head_dim, dtype=dtype)
        table = torch.zeros(4, context // config.block_size, dtype=INDEX)
        path = "one partition" if context <= DECODE_PARTITION_SIZE else "split"
        with recorded_launches(f"paged_decode_attention ({path})") as calls:
            paged_decode_attention(q, cache, cache, table, torch.full((4,), context, dtype=INDEX), 0.1)
        recorded += calls
    q = torch.zeros(PREFILL_TOKENS, num_heads, config.head_dim, dtype=dtype)
    table = torch.zeros(1, LONG_CONTEXT // config.block_size, dtype=INDEX)
    starts = torch.tensor([0, PREFILL_TOKENS], dtype=INDEX)
    with recorded_launches("paged_prefill_attention") as calls:
        lens = torch.tensor([PREFILL_TOKENS], dtype=INDEX)
        paged_prefill_attention(q, cache, cache, table, starts, lens, 0.1, PREFILL_TOKENS)
    recorded += calls
    layers = torch.zeros(2, 2, 4, config.block_size, NUM_KV_HEADS, config.head_dim, dtype=dtype)
    with recorded_launches("copy_blocks") as calls:
        copy_blocks(layers, layers.clone(), torch.tensor([[0, 1]], dtype=INDEX))
    recorded += calls
    return recorded


def matrix(quick: bool = False, dtypes: Sequence[str] = tuple(DTYPES)) -> list[Config]:
    if quick:  # the most registers and shared memory each kernel asks for, in both dot precisions
        return [Config(dtype, 128, 32, 8) for dtype in ("bf16", "fp32") if dtype in dtypes]
    return [Config(*values) for values in itertools.product(dtypes, HEAD_DIMS, BLOCK_SIZES, GROUPS)]


def compile_launch(launch: Launch, config: Config, target: Target) -> Result:
    source, options = launch.source()
    name = launch.kernel.fn.__name__
    started = time.perf_counter()
    try:
        compiled = triton.compile(source, target=target.triton, options=options)
        registers, spills = ptxas_usage(compiled.asm["ptx"], compiled.metadata.name, target)
    except Exception as error:  # a compile error is this check's finding, reported with the rest
        # Triton's message quotes the kernel's source first; its last line says what is wrong.
        message = [line for line in str(error).splitlines() if line.strip()][-1].strip()[:300]
        return Result(name, launch.what, str(config), target, 0, 0, 0, options.get("num_warps", 4), 0.0, message)
    elapsed = time.perf_counter() - started
    return Result(
        name, launch.what, str(config), target, registers, spills, compiled.metadata.shared,
        compiled.metadata.num_warps, elapsed,
    )  # fmt: skip


def ptxas_usage(ptx: str, kernel_name: str, target: Target) -> tuple[int, int]:
    """Registers per thread and spill bytes (stores + loads) of one kernel, from ``ptxas -v``: the ptxas Triton
    bundles and picks for the target, with the options it builds the cubin with."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        command = [
            get_ptxas(target.capability).path,
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(target.capability)}",
            str(path),
            "-o",
            f"{path}.cubin",
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"ptxas: {result.stderr.strip()}")
    info = result.stderr[result.stderr.index(f"'{kernel_name}'") :]
    registers = int(re.search(r"Used (\d+) registers", info)[1])
    stores, loads = (int(v) for v in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups())
    return registers, stores + loads


def check(configs: list[Config]) -> list[Result]:
    """Every launch of ``configs`` for every target, a configuration per worker process (one per core)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 makes every kernel an interpreted one: unset it to compile them")
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        return [result for results in pool.map(_check_config, configs) for result in results]


def _check_config(config: Config) -> list[Result]:
    return [compile_launch(launch, config, target) for launch in launches(config) for target in TARGETS]


def table(results: list[Result]) -> str:
    lines = [
        "| kernel | launch | configuration | target | registers | spills (B) | shared (KiB) | warps | occupancy | "
        "result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        outcome = "; ".join(r.problems) or "ok"
        lines.append(
            f"| {r.kernel} | {r.what} | {r.config} | {r.target.name} | {r.registers} | {r.spill_bytes} | "
            f"{r.shared_bytes / 1024:.1f} | {r.num_warps} | {r.occupancy:.0%} | {outcome} |"
        )
    return "\n".join(lines)


def grouped_table(results: list[Result]) -> str:
    """One row per kernel, launch and target over every configuration: the ranges, and how many failed."""
    groups: dict[tuple[str, str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.kernel, r.what, r.target.name), []).append(r)
    lines = [
        "| kernel | launch | target | configurations | registers | max spills (B) | max shared (KiB) | warps | "
        "occupancy | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (kernel, what, target), group in groups.items():
        registers = sorted(r.registers for r in group)
        occupancy = sorted(r.occupancy for r in group)
        warps = "/".join(str(w) for w in sorted({r.num_warps for r in group}))
        lines.append(
            f"| {kernel} | {what} | {target} | {len(group)} | {registers[0]}-{registers[-1]} | "
            f"{max(r.spill_bytes for r in group)} | {max(r.shared_bytes for r in group) / 1024:.1f} | {warps} | "
            f"{occupancy[0]:.0%}-{occupancy[-1]:.0%} | {sum(bool(r.problems) for r in group)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the largest configuration of each kernel")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if unknown := set(dtypes) - set(DTYPES):
        parser.error(f"unknown dtypes {sorted(unknown)}; choose from {', '.join(DTYPES)}")
    started = time.perf_counter()
    results = check(matrix(args.quick, dtypes))
    print(table(results))
    print(summary(results, time.perf_counter() - started))
    return 1 if any(r.problems for r in results) else 0


def summary(results: list[Result], elapsed_s: float) -> str:
    failed = sum(bool(r.problems) for r in results)
    kernels = len({r.kernel for r in results})
    return (
        f"{len(results)} compiles of {kernels} kernels for {', '.join(t.name for t in TARGETS)} in {elapsed_s:.0f} s "
        f"(triton {triton.__version__} and the ptxas it bundles): {failed} failed"
    )


if __name__ == "__main__":
    sys.exit(main())
