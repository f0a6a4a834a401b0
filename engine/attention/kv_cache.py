"""Paged KV cache storage, its size arithmetic, and batched block moves between pools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.attention.backend import AttentionBackend, KVCacheLayer
from engine.host_memory import zeros_on_huge_pages


class KVCacheShape(Protocol):
    """What the cache's layout needs of a model (``engine.model.config.ModelConfig`` has it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_cache_bytes_per_block(config: KVCacheShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across all layers, K and V together."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


class PagedKVCache:
    """All layers' K and V blocks in one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

    One tensor makes moving a set of blocks (every layer, K and V) a single
    indexed copy. ``layers`` are per-layer ``(K, V)`` views, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``. In host memory (not pinned) it sits on huge pages
    (``engine.host_memory.zeros_on_huge_pages``).
    """

    def __init__(
        self,
        config: KVCacheShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> None:
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"num_blocks must be >= 0 and block_size > 0, got {num_blocks}, {block_size}")
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        if torch.device(device).type == "cpu" and not pin_memory:
            self.data = zeros_on_huge_pages(shape, dtype)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers: list[KVCacheLayer] = [(layer[0], layer[1]) for layer in self.data]


def move_blocks(
    src: PagedKVCache, dst: PagedKVCache, block_pairs: Sequence[tuple[int, int]], backend: AttentionBackend
) -> None:
    """Copy blocks ``src[a] -> dst[b]`` for every pair, all layers, K and V, with one call of the backend."""
    if block_pairs:
        backend.copy_blocks(src.data, dst.data, torch.tensor(block_pairs, dtype=torch.int64))
