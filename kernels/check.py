"""Correctness checks of every Triton kernel against its reference, on any device and dtype.

The test suite runs them on the CPU under Triton's interpreter with small shapes; ``scripts/gpu_check.sh``
runs ``python -m kernels.check --device cuda`` on a GPU with realistic shapes in bfloat16 and float32.
Every case draws fresh random inputs and poisons what the kernel must write (NaN), so a slot the kernel
skips shows up; attention is also compared with a float64 computation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from kernels.reference import (
    copy_blocks_reference,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    reshape_and_cache_reference,
)
from kernels.triton_block_copy import copy_blocks
from kernels.triton_paged_attention import paged_decode_attention, paged_prefill_attention, reshape_and_cache

# max |out - expected| / max |expected|. float32: only the summation order differs from float64. bfloat16:
# inputs are the same bf16 values; the kernel rounds probabilities and the output to bf16 (2^-8 relative).
RELATIVE_ERROR_BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass
class CheckResult:
    kernel: str
    case: str
    dtype: str
    error: float  # against the reference (copies: number of wrong elements)
    error_vs_float64: float | None
    bound: float
    passed: bool


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("inf")
    return ((out.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def layer_views(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of layer 1 of a 2-layer cache, as the engine passes them: strided views of one tensor."""
    cache = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    return cache[1, 0], cache[1, 1]


def random_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, device: str) -> torch.Tensor:
    """Non-overlapping tables in random block order, zero-padded like the engine's."""
    needed = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(num_blocks)
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int64)
    start = 0
    for i, count in enumerate(needed):
        tables[i, :count] = order[start : start + count]
        start += count
    return tables.to(device)


def dense_float64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions, in float64 with explicit GQA expansion."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (x.double().repeat_interleave(group, dim=1) for x in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    query_pos = torch.arange(keys.shape[0] - q.shape[0], keys.shape[0], device=q.device)
    scores.masked_fill_(torch.arange(keys.shape[0], device=q.device)[None, :] > query_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def check_reshape_and_cache(
    device: str, dtype: torch.dtype, num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int
) -> CheckResult:
    num_heads = num_kv_heads * 2
    num_blocks = -(-num_tokens // block_size) + 4
    k_cache, v_cache = layer_views(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    for cache in (k_cache, v_cache):  # poison the slots to be written
        cache.view(-1, num_kv_heads, head_dim)[slots] = float("nan")
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    # K and V as the model makes them: column slices of one fused projection, so rows are strided.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_reference(key, value, expected_k, expected_v, slots)
    wrong = sum(int((~torch.eq(a, b)).sum()) for a, b in ((k_cache, expected_k), (v_cache, expected_v)))
    case = _describe(tokens=num_tokens, kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    return CheckResult("reshape_and_cache", case, str(dtype), wrong, None, 0, wrong == 0)


def check_decode(
    device: str,
    dtype: torch.dtype,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    **kernel_options: int,
) -> CheckResult:
    k_cache, v_cache, tables = _paged_contexts(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    lens = torch.tensor(seq_lens, device=device)
    q = torch.randn(len(seq_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out, **kernel_options)
    reference = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    one_query_each = list(range(len(seq_lens) + 1))
    return _attention_result(
        "paged_decode_attention",
        dtype,
        relative_error(out, reference),
        _error_vs_float64(out, q, one_query_each, k_cache, v_cache, tables, seq_lens, scale),
        heads=f"{num_heads}/{num_kv_heads}",
        head_dim=head_dim,
        block_size=block_size,
        seq_lens=_summary(seq_lens),
        **kernel_options,
    )


def check_prefill(
    device: str,
    dtype: torch.dtype,
    chunks: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    **kernel_options: int,
) -> CheckResult:
    """``chunks``: (cached prefix, new tokens) per sequence."""
    seq_lens = [prefix + new for prefix, new in chunks]
    k_cache, v_cache, tables = _paged_contexts(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], num_heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    max_query_len = max(new for _, new in chunks)
    lens = torch.tensor(seq_lens, device=device)
    args = (q, k_cache, v_cache, tables, torch.tensor(starts, device=device), lens, scale, max_query_len)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(*args, out=out, **kernel_options)
    return _attention_result(
        "paged_prefill_attention",
        dtype,
        relative_error(out, paged_prefill_attention_reference(*args)),
        _error_vs_float64(out, q, starts, k_cache, v_cache, tables, seq_lens, scale),
        heads=f"{num_heads}/{num_kv_heads}",
        head_dim=head_dim,
        block_size=block_size,
        chunks=_summary(chunks),
        **kernel_options,
    )


def _paged_contexts(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches with a few spare blocks, and random block tables for contexts of ``seq_lens``."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    k_cache, v_cache = layer_views(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    return k_cache, v_cache, random_block_tables(seq_lens, block_size, num_blocks, device)


def _error_vs_float64(
    out: torch.Tensor,
    q: torch.Tensor,
    query_start_loc: list[int],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> float:
    """The worst sequence's error against causal attention in float64 over its own context."""
    errors = []
    for i, seq_len in enumerate(seq_lens):
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        keys, values = (c[tables[i]].flatten(0, 1)[:seq_len] for c in (k_cache, v_cache))
        errors.append(relative_error(out[rows], dense_float64(q[rows], keys, values, scale)))
    return max(errors)


def _attention_result(
    kernel: str, dtype: torch.dtype, error: float, error_vs_float64: float, **description: object
) -> CheckResult:
    bound = RELATIVE_ERROR_BOUNDS[dtype]
    passed = max(error, error_vs_float64) < bound
    return CheckResult(kernel, _describe(**description), str(dtype), error, error_vs_float64, bound, passed)


def check_copy_blocks(
    src_device: str, dst_device: str, dtype: torch.dtype, num_pairs: int, block_shape: tuple[int, ...]
) -> CheckResult:
    """Moves between two caches (``src_device`` -> ``dst_device``; a host one is pinned when the other is on
    CUDA) or, with equal devices, within one cache as copy-on-write does."""
    within = src_device == dst_device
    num_blocks = 3 * num_pairs

    def cache(device: str) -> torch.Tensor:
        pinned = device == "cpu" and "cuda" in (src_device, dst_device)
        data = torch.randn(block_shape[0], 2, num_blocks, *block_shape[1:]).to(dtype)
        return data.pin_memory() if pinned else data.to(device)

    src = cache(src_device)
    dst = src if within else cache(dst_device)
    order = torch.randperm(num_blocks)
    targets = order[:num_pairs]
    sources = order[num_pairs : 2 * num_pairs] if within else torch.randperm(num_blocks)[:num_pairs]
    dst[:, :, targets.to(dst.device)] = float("nan")  # poison what must be overwritten
    mapping = torch.stack([sources, targets], dim=1)
    expected = dst.clone()
    copy_blocks_reference(src.clone(), expected, mapping)
    copy_blocks(src, dst, mapping)
    if dst.device.type == "cpu" and src.device.type == "cuda":
        torch.cuda.synchronize()  # the kernel wrote host memory asynchronously
    wrong = int((~torch.eq(dst, expected)).sum())
    case = _describe(direction=f"{src_device}->{dst_device}", pairs=num_pairs, block=list(block_shape))
    return CheckResult("copy_blocks", case, str(dtype), wrong, None, 0, wrong == 0)


def _describe(**fields: object) -> str:
    return " ".join(f"{name}={value}" for name, value in fields.items())


def _summary(values: list) -> str:
    return str(values) if len(values) <= 6 else f"{values[:6]}...({len(values)})"


Check = Callable[[], CheckResult]

GQA_SHAPES = [(4, 4), (9, 3), (8, 2)]  # (query heads, KV heads): ratios 1, 3, 4


def interpreter_checks(device: str = "cpu") -> list[Check]:
    """Small float32 cases for Triton's interpreter: ragged lengths, partial last blocks, random block order,
    tiles spanning several blocks, split contexts, GQA ratios 1, 3, 4."""
    checks: list[Check] = [partial(check_reshape_and_cache, device, torch.float32, 17, 3, 32, 4)]
    for num_heads, num_kv_heads in GQA_SHAPES:
        decode = partial(
            check_decode, device, torch.float32, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32
        )
        checks += [
            # one partition: the kernel normalises and stores directly
            partial(decode, [70, 1, 33, 16, 5, 64], block_size=16, partition_size=512, block_n=16),
            # up to 5 partitions merged; 16-token tiles span 4 blocks of 4
            partial(decode, [150, 1, 97, 31, 64, 2], block_size=4, partition_size=32, block_n=16),
            # some sequences in one partition, others in two
            partial(decode, [40, 1, 32, 33, 7], block_size=16, partition_size=32, block_n=16),
            # a fresh prompt, chunks after a prefix ending mid-block and on a block edge, a one-token chunk,
            # a chunk longer than one 16-row tile
            partial(
                check_prefill,
                device,
                torch.float32,
                [(0, 13), (7, 9), (8, 1), (5, 37), (0, 1)],
                num_heads,
                num_kv_heads,
                32,
                4,
                block_m=16,
                block_n=16,
            ),
        ]
    block_shape = (3, 4, 3, 32)  # layers, block_size, kv_heads, head_dim
    checks += [partial(check_copy_blocks, device, device, torch.float32, 5, block_shape)]
    return checks


MODEL_SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def gpu_checks() -> list[Check]:
    """Realistic shapes on CUDA, bfloat16 (the engine's dtype there) and float32, default kernel tiles."""
    checks: list[Check] = []
    for dtype in (torch.bfloat16, torch.float32):
        for num_heads, num_kv_heads, head_dim in MODEL_SHAPES.values():
            checks += [
                partial(check_reshape_and_cache, "cuda", dtype, 1000, num_kv_heads, head_dim, 16),
                partial(
                    check_decode,
                    "cuda",
                    dtype,
                    [1, 17, 512, 513, 4097, 300, 2048, 33],
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    16,
                ),
                partial(check_decode, "cuda", dtype, [31, 16, 200, 5], num_heads, num_kv_heads, head_dim, 16),
                partial(
                    check_prefill,
                    "cuda",
                    dtype,
                    [(0, 300), (100, 129), (4000, 1), (17, 700), (0, 1)],
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    16,
                ),
            ]
        block_shape = (32, 16, 8, 128)
        for src, dst in (("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")):
            checks.append(partial(check_copy_blocks, src, dst, dtype, 64, block_shape))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="check every Triton kernel against its reference")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu needs TRITON_INTERPRET=1")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    checks = gpu_checks() if args.device == "cuda" else interpreter_checks()
    results = []
    for check in checks:
        torch.manual_seed(len(results))
        result = check()
        results.append(result)
        status = "ok  " if result.passed else "FAIL"
        f64 = "" if result.error_vs_float64 is None else f" vs_f64={result.error_vs_float64:.1e}"
        print(f"{status} {result.kernel:24} {result.dtype:15} error={result.error:.1e}{f64} {result.case}", flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed}/{len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
