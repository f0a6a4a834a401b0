"""Paged decode attention on the CPU: a compiled C++ kernel and the pure-torch reference it must match.

The C++ kernel is built on first use with PyTorch's JIT extension loader (needs a
C++ compiler and ninja) and cached under ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


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
    """q: [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks]; returns [B, H, D].

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


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as the reference; float32 CPU tensors only."""
    out = torch.empty_like(q)
    compiled_kernels().paged_decode_attention(
        out, q.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale
    )
    return out


@functools.cache
def compiled_kernels() -> ModuleType:
    """Build (first time on this machine, then from cache) and load the C++ kernels."""
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    module = load(
        name="kvstorm_cpu_kernels",
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    elapsed = time.perf_counter() - start
    if elapsed > 5:
        print(f"kvstorm: built the CPU attention kernel in {elapsed:.0f} s (cached from now on)", file=sys.stderr)
    return module


def cpu_kernels_available() -> bool:
    """True when the C++ kernel builds and loads here; False (with the reason on stderr) otherwise."""
    try:
        compiled_kernels()
    except Exception as error:  # a missing compiler or ninja must not stop the engine: it falls back
        print(f"kvstorm: CPU attention kernel unavailable, using the torch reference ({error})", file=sys.stderr)
        return False
    return True
