"""kvstorm's C++ kernels for the CPU (``kernels/csrc``): decode attention from the paged cache, RMSNorm and rotary
embeddings. Built on first use with PyTorch's JIT extension loader (needs a C++ compiler and ninja) and cached
under ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
# What the kernels compute on (activations and the KV cache).
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def cpu_kernels_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels take tensors of this device and dtype (not whether they build: ``cpu_kernels_available``)."""
    return device.type == "cpu" and dtype in CPU_KERNEL_DTYPES


@functools.cache
def compiled_kernels() -> ModuleType:
    """Build (first time on this machine, then from cache) and load the C++ kernels."""
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    module = load(
        name="kvstorm_cpu_kernels",
        sources=[str(source) for source in SOURCES],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    elapsed = time.perf_counter() - start
    if elapsed > 5:
        print(f"kvstorm: built the CPU kernels in {elapsed:.0f} s (cached from now on)", file=sys.stderr)
    return module


def cpu_kernels_available() -> bool:
    """True when the C++ kernels build and load here; False (with the reason on stderr) otherwise."""
    try:
        compiled_kernels()
    except Exception as error:  # a missing compiler or ninja must not stop the engine: it falls back
        print(f"kvstorm: CPU kernels unavailable, using the torch reference ({error})", file=sys.stderr)
        return False
    return True
