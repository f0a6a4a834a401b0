"""One Triton launch that moves many KV blocks between two whole caches (same signature as
``copy_blocks_reference``).

Device to device, and device to/from host: on CUDA a pinned host tensor is mapped into the GPU's address space
(unified virtual addressing), so the kernel reads or writes host blocks in place over the bus, with no staging
buffer and no per-block copy call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_CHUNK = 4096  # elements per program: 8 KiB of bf16


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    block_mapping_ptr,
    src_layer_stride,
    dst_layer_stride,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One program: one chunk of one (layer, K or V) slice of one block pair.
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src_block = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < BLOCK_NUMEL
    values = tl.load(src_ptr + layer * src_layer_stride + src_block * BLOCK_NUMEL + offsets, mask=mask)
    tl.store(dst_ptr + layer * dst_layer_stride + dst_block * BLOCK_NUMEL + offsets, values, mask=mask)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``dst[:, :, b] = src[:, :, a]`` for each row ``(a, b)`` of ``block_mapping`` ([P, 2] int64).

    ``src``/``dst``: contiguous ``[L, 2, N, ...]`` caches; a host-side one must be pinned when the other is on
    CUDA (under the interpreter everything is on the CPU).
    """
    if block_mapping.numel() == 0:
        return
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
        raise ValueError(f"caches differ: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_blocks needs contiguous caches")
    gpu = src.device if src.device.type == "cuda" else dst.device
    for cache in (src, dst):
        if gpu.type == "cuda" and cache.device.type == "cpu" and not cache.is_pinned():
            raise ValueError("a host cache must be pinned for the GPU to reach it")
    block_numel = src[0, 0, 0].numel()
    num_layer_slices = src.shape[0] * 2
    grid = (block_mapping.shape[0], num_layer_slices, triton.cdiv(block_numel, COPY_CHUNK))
    _copy_blocks_kernel[grid](
        src.view(num_layer_slices, -1),
        dst.view(num_layer_slices, -1),
        block_mapping.to(gpu, non_blocking=True).contiguous(),
        src.shape[2] * block_numel,
        dst.shape[2] * block_numel,
        BLOCK_NUMEL=block_numel,
        CHUNK=min(COPY_CHUNK, triton.next_power_of_2(block_numel)),
    )
