"""Attention over the paged KV cache with PyTorch ops (the reference, and the CPU fallback where the compiled
kernel does not apply or build).

Decodes (one new token each) are attended in one batch (gather blocks, padded SDPA). Prefill chunks attend one
sequence at a time with SDPA, straight from the new K/V when nothing of the sequence is cached yet.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, KVCacheLayer, attend_decodes
from engine.core.kv_cache_manager import num_blocks_for
from kernels.reference import (
    causal_attention,
    copy_blocks_reference,
    gather_blocks,
    paged_decode_attention_reference,
    reshape_and_cache_reference,
)


class TorchAttentionBackend:
    """Writes K/V into the paged cache, then attends: decodes in one batch, prefill chunks one by one."""

    copy_blocks = staticmethod(copy_blocks_reference)
    name = "torch"
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
        reshape_and_cache_reference(k, v, kv_cache[0], kv_cache[1], metadata.slot_mapping)
        out = torch.empty_like(q)
        attend_decodes(paged_decode_attention_reference, q, kv_cache, metadata, scale, out)
        block_size = kv_cache[0].shape[1]
        for i in metadata.prefill_indices:
            rows = slice(metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1])
            seq_len = metadata.seq_lens_cpu[i]
            if rows.stop - rows.start == seq_len:  # nothing cached before this chunk: attend to its own K/V
                keys, values = k[rows], v[rows]
            else:
                block_table = metadata.block_tables[i : i + 1, : num_blocks_for(seq_len, block_size)]
                keys = gather_blocks(kv_cache[0], block_table)[0, :seq_len]
                values = gather_blocks(kv_cache[1], block_table)[0, :seq_len]
            out[rows] = causal_attention(q[rows], keys, values, scale)
        return out
