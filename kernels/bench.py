"""Times every Triton kernel against its torch reference and reports achieved bandwidth.

    python -m kernels.bench --json kernels.json            # on a GPU: realistic shapes
    TRITON_INTERPRET=1 python -m kernels.bench --device cpu --shapes smoke   # plumbing only, no meaningful times

Shapes: SmolLM2-135M (9 query / 3 KV heads, head_dim 64) and Llama-3-8B (32 / 8, head_dim 128), block_size
16, decode batch 1..256 and context 128..32k (capped at 1M cached tokens per case). Memory-bound kernels report
bytes moved / time and that as a fraction of the device's copy bandwidth measured in the same run (bytes read
plus written by a large device-to-device copy); prefill attention reports TFLOP/s. A sweep of the decode
kernel's tile options at batch 64, context 4k, Llama-3-8B shape shows what the defaults leave on the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.check import MODEL_SHAPES, layer_views, random_block_tables
from kernels.reference import (
    copy_blocks_reference,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    reshape_and_cache_reference,
)
from kernels.triton_block_copy import copy_blocks
from kernels.triton_paged_attention import paged_decode_attention, paged_prefill_attention, reshape_and_cache

BLOCK_SIZE = 16
MAX_CACHED_TOKENS = 1 << 20


def time_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds per call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def measure_copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes read plus written per second by one large device-to-device copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / (time_ms(lambda: dst.copy_(src), device) / 1e3)


def decode_cases(shapes: str) -> list[tuple[str, int, int]]:
    """(model, batch, context) points."""
    if shapes == "smoke":
        return [("smollm2-135m", 2, 40)]
    return [
        (model, batch, context)
        for model in MODEL_SHAPES
        for batch in (1, 16, 64, 256)
        for context in (128, 1024, 4096, 32768)
        if batch * context <= MAX_CACHED_TOKENS
    ]


def bench_decode(model: str, batch: int, context: int, dtype: torch.dtype, device: str, **options: int) -> dict:
    num_heads, num_kv_heads, head_dim = MODEL_SHAPES[model]
    num_blocks = batch * -(-context // BLOCK_SIZE)
    k_cache, v_cache = layer_views(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype, device)
    tables = random_block_tables([context] * batch, BLOCK_SIZE, num_blocks, device)
    seq_lens = torch.full((batch,), context, device=device)
    q = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
    args = (q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
    return {
        "kernel": "paged_decode_attention",
        "model": model,
        "case": f"batch={batch} context={context}" + "".join(f" {k}={v}" for k, v in options.items()),
        "bytes": kv_bytes + 2 * q.numel() * q.element_size(),
        "triton_ms": time_ms(lambda: paged_decode_attention(*args, **options), device),
        "reference_ms": None if options else time_ms(lambda: paged_decode_attention_reference(*args), device),
    }


def bench_prefill(model: str, num_seqs: int, prefix: int, new: int, dtype: torch.dtype, device: str) -> dict:
    num_heads, num_kv_heads, head_dim = MODEL_SHAPES[model]
    seq_len = prefix + new
    num_blocks = num_seqs * -(-seq_len // BLOCK_SIZE)
    k_cache, v_cache = layer_views(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype, device)
    tables = random_block_tables([seq_len] * num_seqs, BLOCK_SIZE, num_blocks, device)
    query_start_loc = torch.arange(0, (num_seqs + 1) * new, new, device=device)
    seq_lens = torch.full((num_seqs,), seq_len, device=device)
    q = torch.randn(num_seqs * new, num_heads, head_dim, device=device).to(dtype)
    args = (q, k_cache, v_cache, tables, query_start_loc, seq_lens, head_dim**-0.5, new)
    visible_keys = num_seqs * sum(prefix + j + 1 for j in range(new))
    return {
        "kernel": "paged_prefill_attention",
        "model": model,
        "case": f"seqs={num_seqs} prefix={prefix} new={new}",
        "flops": 4 * num_heads * head_dim * visible_keys,
        "triton_ms": time_ms(lambda: paged_prefill_attention(*args), device),
        "reference_ms": time_ms(lambda: paged_prefill_attention_reference(*args), device),
    }


def bench_reshape_and_cache(model: str, num_tokens: int, dtype: torch.dtype, device: str) -> dict:
    _, num_kv_heads, head_dim = MODEL_SHAPES[model]
    num_blocks = -(-num_tokens // BLOCK_SIZE) * 2
    k_cache, v_cache = layer_views(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype, device)
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    args = (key, value, k_cache, v_cache, slots)
    return {
        "kernel": "reshape_and_cache",
        "model": model,
        "case": f"tokens={num_tokens}",
        "bytes": 2 * 2 * key.numel() * key.element_size(),  # K and V, read and written
        "triton_ms": time_ms(lambda: reshape_and_cache(*args), device),
        "reference_ms": time_ms(lambda: reshape_and_cache_reference(*args), device),
    }


def bench_copy_blocks(
    model: str, num_layers: int, num_pairs: int, src_device: str, dst_device: str, dtype: torch.dtype
) -> dict:
    _, num_kv_heads, head_dim = MODEL_SHAPES[model]
    shape = (num_layers, 2, 2 * num_pairs, BLOCK_SIZE, num_kv_heads, head_dim)
    pinned = "cuda" in (src_device, dst_device)

    def cache(device: str) -> torch.Tensor:
        if device == "cpu":
            return torch.zeros(shape, dtype=dtype, pin_memory=pinned)
        return torch.zeros(shape, dtype=dtype, device=device)

    src, dst = cache(src_device), cache(dst_device)
    mapping = torch.stack([torch.randperm(2 * num_pairs)[:num_pairs], torch.randperm(2 * num_pairs)[:num_pairs]], 1)
    moved = num_pairs * src[:, :, 0].numel() * src.element_size()
    within_device = src_device == dst_device
    return {
        "kernel": "copy_blocks",
        "model": model,
        "case": f"{src_device}->{dst_device} layers={num_layers} blocks={num_pairs}",
        # On one device a copy reads and writes every byte (comparable with the copy bandwidth); across the bus
        # the bytes moved are what counts.
        "bytes": moved * (2 if within_device else 1),
        "triton_ms": time_ms(lambda: copy_blocks(src, dst, mapping), src_device if within_device else "cuda"),
        "reference_ms": time_ms(
            lambda: copy_blocks_reference(src, dst, mapping), src_device if within_device else "cuda"
        ),
    }


def run(device: str, shapes: str, dtype: torch.dtype) -> dict:
    smoke = shapes == "smoke"
    copy_bandwidth = measure_copy_bandwidth(device, 1 << (20 if smoke else 32))
    rows = [bench_decode(model, batch, context, dtype, device) for model, batch, context in decode_cases(shapes)]
    prefill_cases = [(2, 0, 24)] if smoke else [(4, 0, 512), (1, 0, 4096), (8, 2048, 256)]
    models = ["smollm2-135m"] if smoke else list(MODEL_SHAPES)
    rows += [bench_prefill(m, *case, dtype, device) for m in models for case in prefill_cases]
    rows += [bench_reshape_and_cache(m, 32 if smoke else 4096, dtype, device) for m in models]
    if smoke:
        rows.append(bench_copy_blocks("smollm2-135m", 2, 4, device, device, dtype))
    else:
        for src, dst in (("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")):
            rows.append(bench_copy_blocks("llama3-8b", 32, 256, src, dst, dtype))
        for partition_size in (256, 512, 1024):
            for block_n in (32, 64, 128):
                for num_warps in (4, 8):
                    options = {"partition_size": partition_size, "block_n": block_n, "num_warps": num_warps}
                    rows.append(bench_decode("llama3-8b", 64, 4096, dtype, device, **options))
    for row in rows:
        row["speedup"] = row["reference_ms"] / row["triton_ms"] if row["reference_ms"] else None
        if "bytes" in row:
            row["bandwidth_gbps"] = row["bytes"] / row["triton_ms"] / 1e6
            row["fraction_of_copy_bandwidth"] = row["bandwidth_gbps"] * 1e9 / copy_bandwidth
        if "flops" in row:
            row["tflops"] = row["flops"] / row["triton_ms"] / 1e9
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    return {"device": name, "dtype": str(dtype), "copy_bandwidth_gbps": copy_bandwidth / 1e9, "rows": rows}


def render_table(result: dict) -> str:
    lines = [
        f"Device: {result['device']}, {result['dtype']}, block_size {BLOCK_SIZE}; device copy bandwidth "
        f"{result['copy_bandwidth_gbps']:.0f} GB/s (read + written).",
        "",
        "| kernel | model | case | triton ms | torch ms | speed-up | GB/s | of copy bw | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        cells = [
            row["kernel"],
            row["model"],
            row["case"],
            f"{row['triton_ms']:.3f}",
            f"{row['reference_ms']:.3f}" if row["reference_ms"] else "",
            f"{row['speedup']:.1f}x" if row["speedup"] else "",
            f"{row['bandwidth_gbps']:.0f}" if "bandwidth_gbps" in row else "",
            f"{100 * row['fraction_of_copy_bandwidth']:.0f}%" if "fraction_of_copy_bandwidth" in row else "",
            f"{row['tflops']:.1f}" if "tflops" in row else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="time the Triton kernels against their torch references")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu needs TRITON_INTERPRET=1")
    parser.add_argument("--shapes", choices=["full", "smoke"], default="full")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = parser.parse_args(argv)
    result = run(args.device, args.shapes, getattr(torch, args.dtype))
    print(render_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
