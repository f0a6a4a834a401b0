"""Allocation of the paged KV cache tensors and the arithmetic of their size."""

from __future__ import annotations

import torch

from engine.attention.backend import KVCacheLayer
from engine.model.config import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across all layers, K and V together."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCacheLayer]:
    """One (K, V) pair per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]
