"""Attention over the paged KV cache with the compiled CPU kernel (the CPU default where it builds).

Per layer and step: the new K/V are written into their slots, then one kernel call attends every row of the step,
decodes and prefill chunks alike, straight from the cache. Each row is computed alone, so a request's tokens do not
depend on how its prompt was chunked or what else ran in the step (``kernels/csrc/paged_attention.cpp``).
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, KVCacheLayer
from kernels.cpu_paged_attention import paged_attention_cpu
from kernels.reference import copy_blocks_reference, reshape_and_cache_reference


class CpuAttentionBackend:
    copy_blocks = staticmethod(copy_blocks_reference)
    name = "cpu"
    fuses_into_decoder_layer = True

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
        reshape_and_cache_reference(k, v, k_cache, v_cache, metadata.slot_mapping)
        row_seqs, row_lens = metadata.row_contexts
        return paged_attention_cpu(q, k_cache, v_cache, metadata.block_tables, row_seqs, row_lens, scale)
