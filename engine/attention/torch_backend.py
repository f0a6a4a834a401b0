"""Reference attention over the paged KV cache in plain PyTorch (the CPU default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata, KVCacheLayer


def write_kv_to_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Scatter the step's new K/V rows into their slots."""
    k_cache, v_cache = kv_cache
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_context(
    kv_cache: KVCacheLayer, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` K and V rows of one sequence: [seq_len, num_kv_heads, head_dim]."""
    k_cache, v_cache = kv_cache
    block_size = k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks]
    keys = k_cache[blocks].flatten(0, 1)[:seq_len]
    values = v_cache[blocks].flatten(0, 1)[:seq_len]
    return keys, values


class TorchAttentionBackend:
    """Writes K/V into the paged cache and attends sequence by sequence with SDPA."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_to_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
            end = start + query_len
            keys, values = gather_context(kv_cache, metadata.block_tables[i], seq_len)
            out[start:end] = attend(q[start:end], keys, values, scale)
            start = end
        return out


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (the last ``len(q)`` positions of the context) over ``keys``/``values``.

    q: [Q, H, D]; keys, values: [S, KVH, D] with S >= Q. Returns [Q, H, D].
    """
    query_len, seq_len = q.shape[0], keys.shape[0]
    qh = q.transpose(0, 1)  # [H, Q, D]
    kh = keys.transpose(0, 1)  # [KVH, S, D]
    vh = values.transpose(0, 1)
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at absolute position seq_len - query_len + j and sees keys up to there.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
