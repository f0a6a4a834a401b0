"""Paged decode attention on the CPU: a compiled C++ kernel (``kernels/csrc/paged_decode_attention.cpp``) with
the signature of its pure-torch reference (``kernels.reference.paged_decode_attention_reference``)."""

from __future__ import annotations

import torch

from kernels.cpu_extension import compiled_kernels


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``paged_decode_attention_reference``; CPU tensors, a float32 or bfloat16 cache. Scores and
    sums are float32 whatever the cache holds (q is widened, the result narrowed to q's dtype)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    compiled_kernels().paged_decode_attention(
        out, q.float().contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale
    )
    return out.to(q.dtype)
