"""Attention over the paged KV cache on the CPU, for decode and prefill rows alike: a compiled C++ kernel
(``kernels/csrc/paged_attention.cpp``)."""

from __future__ import annotations

import torch

from kernels.cpu_extension import compiled_kernels


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_seqs: torch.Tensor,
    row_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Row ``r`` of ``q`` [R, H, D] attends to the first ``row_lens[r]`` tokens of the context of sequence
    ``row_seqs[r]`` (its blocks: that row of ``block_tables``). CPU tensors; q and the cache float32 or bfloat16; scores
    and sums are float32 whatever the cache holds (q is widened, the result narrowed to q's dtype). Each row's
    result depends only on its own query and context, never on the other rows."""
    out = torch.empty(q.shape, dtype=torch.float32)
    compiled_kernels().paged_attention(
        out, q.contiguous(), k_cache, v_cache, block_tables.contiguous(), row_seqs, row_lens, scale
    )
    return out.to(q.dtype)
