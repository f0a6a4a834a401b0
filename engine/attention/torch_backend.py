"""Attention over the paged KV cache with PyTorch ops (the reference, and the CPU default).

Decodes (one new token each) are attended in one batch by a pluggable decode
kernel: the pure-torch reference (gather blocks, padded SDPA) or the compiled
CPU kernel that reads blocks in place. Prefill chunks attend one sequence at a
time with SDPA, straight from the new K/V when nothing of the sequence is
cached yet.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata, KVCacheLayer
from kernels.cpu_decode_attention import gather_blocks, paged_decode_attention_reference

# (q [B, H, D], k_cache, v_cache, block_tables [B, max_blocks], seq_lens [B], scale) -> [B, H, D]
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def write_kv_to_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Scatter the step's new K/V rows into their slots."""
    k_cache, v_cache = kv_cache
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttentionBackend:
    """Writes K/V into the paged cache, then attends: decodes in one batch, prefill chunks one by one."""

    def __init__(self, decode_kernel: DecodeKernel = paged_decode_attention_reference) -> None:
        self.decode_kernel = decode_kernel

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
        if metadata.decode_token_rows.numel():
            out[metadata.decode_token_rows] = self.decode_kernel(
                q[metadata.decode_token_rows],
                kv_cache[0],
                kv_cache[1],
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                scale,
            )
        block_size = kv_cache[0].shape[1]
        for i in metadata.prefill_indices:
            rows = slice(metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1])
            seq_len = metadata.seq_lens_cpu[i]
            if rows.stop - rows.start == seq_len:  # nothing cached before this chunk: attend to its own K/V
                keys, values = k[rows], v[rows]
            else:
                block_table = metadata.block_tables[i : i + 1, : -(-seq_len // block_size)]
                keys = gather_blocks(kv_cache[0], block_table)[0, :seq_len]
                values = gather_blocks(kv_cache[1], block_table)[0, :seq_len]
            out[rows] = prefill_attention(q[rows], keys, values, scale)
        return out


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (the last ``len(q)`` positions of the context) over ``keys``/``values``.

    q: [Q, H, hd]; keys, values: [S, KVH, hd] with S >= Q. Returns [Q, H, hd].
    """
    query_len, seq_len = q.shape[0], keys.shape[0]
    # 4-D [1, heads, len, hd]: PyTorch's CPU flash kernel only takes batched inputs (3-D falls back to math).
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at absolute position seq_len - query_len + j and sees keys up to there.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
