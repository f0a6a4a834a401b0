"""Pure-PyTorch references for every paged-cache kernel; the compiled kernels share these signatures.

Cache layout (one layer): K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A whole cache that moves between pools is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
(blocks on dimension 2). Block tables are int64 ``[num_seqs, max_blocks]``, zero-padded past a sequence's
last block; ``seq_lens`` count a sequence's whole context, the new tokens being its last ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_reference(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write row ``t`` of ``key``/``value`` ([T, KVH, D]) to flat slot ``slot_mapping[t]`` (block * block_size +
    offset) of the caches."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_blocks * block_size, num_kv_heads, head_dim] rows in order."""
    return cache[block_tables].flatten(1, 2)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its whole context. q: [B, H, D]; returns [B, H, D].

    Gathers each sequence's blocks into a padded batch and masks the padding.
    """
    keys = gather_blocks(k_cache, block_tables)  # [B, S, KVH, D]
    values = gather_blocks(v_cache, block_tables)
    mask = torch.arange(keys.shape[1], device=q.device)[None, :] < seq_lens[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (the last ``len(q)`` positions of the context) over ``keys``/``values``.

    q: [Q, H, D]; keys, values: [S, KVH, D] with S >= Q. Returns [Q, H, D].
    """
    query_len, seq_len = q.shape[0], keys.shape[0]
    # 4-D [1, heads, len, D]: PyTorch's CPU flash kernel only takes batched inputs (3-D falls back to math).
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at absolute position seq_len - query_len + j and sees keys up to there.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Varlen causal attention for prefill chunks whose K/V (prefix and chunk) are already in the cache.

    q: [T, H, D], sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i + 1]`` ([S + 1] int64);
    ``max_query_len`` bounds those lengths (the kernels size their grid with it). Returns [T, H, D].
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        table = block_tables[i : i + 1, : -(-seq_len // block_size)]
        keys = gather_blocks(k_cache, table)[0, :seq_len]
        values = gather_blocks(v_cache, table)[0, :seq_len]
        out[starts[i] : starts[i + 1]] = causal_attention(q[starts[i] : starts[i + 1]], keys, values, scale)
    return out


def copy_blocks_reference(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``dst[:, :, b] = src[:, :, a]`` for every row ``(a, b)`` of ``block_mapping`` ([P, 2] int64, on the CPU).

    ``src`` and ``dst`` are whole caches ([L, 2, N, ...]) on the same or different devices: one gather, one
    transfer and one scatter however many blocks move.
    """
    src_ids = block_mapping[:, 0].to(src.device)
    dst_ids = block_mapping[:, 1].to(dst.device)
    # Asynchronous only towards a GPU, where later kernels are ordered after the copy on the stream; a copy
    # to the host must be complete before the CPU scatters it.
    blocks = src.index_select(2, src_ids).to(dst.device, non_blocking=dst.device.type == "cuda")
    dst.index_copy_(2, dst_ids, blocks)
