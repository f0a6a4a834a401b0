"""RMSNorm and rotary embeddings on the CPU in one C++ pass each (``kernels/csrc/layer_ops.cpp``), with the
roundings of the model's pure-torch versions (``engine.model.llama``): where eager PyTorch spends 8-16 operator
calls on each, a decode step of a small batch waits on call overhead, not arithmetic."""

from __future__ import annotations

import torch

from kernels.cpu_extension import compiled_kernels


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` per row of ``x`` [T, dim], sums in float32, the normalised row
    rounded to x's dtype before the weight multiplies it."""
    out = torch.empty(x.shape, dtype=x.dtype)
    compiled_kernels().rms_norm(out, x, weight, eps)
    return out


def rotate_heads_cpu_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotate-half rotary embeddings, in place, of the first ``num_heads`` heads of each row of ``qkv`` [T, width]
    (a fused projection's output: its query and key heads); ``cos`` and ``sin`` [T, 1, head_dim] as
    ``engine.model.llama.RotaryEmbedding`` makes them."""
    compiled_kernels().rotate_heads_(qkv, cos, sin, num_heads, head_dim)
