"""Paged KV cache storage, its size arithmetic, and batched block moves between pools."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.backend import KVCacheLayer
from engine.model.config import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across all layers, K and V together."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


class PagedKVCache:
    """All layers' K and V blocks in one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

    One tensor makes moving a set of blocks (every layer, K and V) a single
    indexed copy. ``layers`` are per-layer ``(K, V)`` views, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> None:
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"num_blocks must be >= 0 and block_size > 0, got {num_blocks}, {block_size}")
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers: list[KVCacheLayer] = [(layer[0], layer[1]) for layer in self.data]


def move_blocks(src: PagedKVCache, dst: PagedKVCache, block_pairs: Sequence[tuple[int, int]]) -> None:
    """Copy blocks ``src[a] -> dst[b]`` for every pair, all layers, K and V, in one gather and one scatter."""
    if not block_pairs:
        return
    src_ids = torch.tensor([a for a, _ in block_pairs], dtype=torch.int64, device=src.data.device)
    dst_ids = torch.tensor([b for _, b in block_pairs], dtype=torch.int64, device=dst.data.device)
    # Asynchronous only towards a GPU, where later kernels are ordered after the copy on the stream; a copy
    # to the host must be complete before the CPU scatters it.
    to_gpu = dst.data.device.type == "cuda"
    blocks = src.data.index_select(2, src_ids).to(dst.data.device, non_blocking=to_gpu)
    dst.data.index_copy_(2, dst_ids, blocks)
