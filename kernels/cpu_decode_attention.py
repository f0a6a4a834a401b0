"""Paged decode attention on the CPU: a compiled C++ kernel with the signature of its pure-torch reference
(``kernels.reference.paged_decode_attention_reference``).

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

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


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
