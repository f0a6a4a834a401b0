"""Attention over the paged KV cache with the Triton kernels (the CUDA default).

Per layer and step: one launch writes the new K/V into their slots, one (plus a merge for long contexts)
attends every decode, one attends every prefill chunk; block moves are one launch per swap.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, KVCacheLayer, attend_decodes
from kernels.triton_block_copy import copy_blocks
from kernels.triton_paged_attention import paged_decode_attention, paged_prefill_attention, reshape_and_cache


class TritonAttentionBackend:
    copy_blocks = staticmethod(copy_blocks)
    name = "triton"
    fuses_into_decoder_layer = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        reshape_and_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        attend_decodes(paged_decode_attention, q, kv_cache, metadata, scale, out)
        if metadata.prefill_indices:
            prefill = metadata.prefill_batch
            out[prefill.token_rows] = paged_prefill_attention(
                q[prefill.token_rows],
                k_cache,
                v_cache,
                prefill.block_tables,
                prefill.query_start_loc,
                prefill.seq_lens,
                scale,
                prefill.max_query_len,
            )
        return out
