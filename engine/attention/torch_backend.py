"""Reference attention over the paged KV cache in plain PyTorch (the CPU default).

Decodes (one new token each) are batched into one padded attention over their
gathered blocks; prefill chunks attend one sequence at a time, straight from
the new K/V when nothing of the sequence is cached yet.
"""

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


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_blocks * block_size, num_kv_heads, head_dim] rows in order."""
    return cache[block_tables].flatten(1, 2)


class TorchAttentionBackend:
    """Writes K/V into the paged cache, then attends: decodes in one batch, prefill chunks one by one."""

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
        if metadata.decode_indices:
            out[metadata.decode_token_rows] = decode_attention(q[metadata.decode_token_rows], kv_cache, metadata, scale)
        decodes = set(metadata.decode_indices)
        starts = metadata.query_start_loc_cpu
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
            if i in decodes:
                continue
            rows = slice(starts[i], starts[i] + query_len)
            if query_len == seq_len:  # nothing cached before this chunk: attend to its own K/V
                keys, values = k[rows], v[rows]
            else:
                block_table = metadata.block_tables[i : i + 1, : -(-seq_len // kv_cache[0].shape[1])]
                keys = gather_blocks(kv_cache[0], block_table)[0, :seq_len]
                values = gather_blocks(kv_cache[1], block_table)[0, :seq_len]
            out[rows] = prefill_attention(q[rows], keys, values, scale)
        return out


def decode_attention(
    q: torch.Tensor, kv_cache: KVCacheLayer, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [D, H, hd], one token per sequence, each attending to its whole context. Returns [D, H, hd]."""
    keys = gather_blocks(kv_cache[0], metadata.decode_block_tables)  # [D, S, KVH, hd]
    values = gather_blocks(kv_cache[1], metadata.decode_block_tables)
    max_len = keys.shape[1]
    # Padding past each sequence's length (zero blocks, stale rows) must get no weight.
    mask = torch.arange(max_len, device=q.device)[None, :] < metadata.decode_seq_lens[:, None]  # [D, S]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [D, H, 1, hd]
        keys.transpose(1, 2),  # [D, KVH, S, hd]
        values.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (the last ``len(q)`` positions of the context) over ``keys``/``values``.

    q: [Q, H, hd]; keys, values: [S, KVH, hd] with S >= Q. Returns [Q, H, hd].
    """
    query_len, seq_len = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at absolute position seq_len - query_len + j and sees keys up to there.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
