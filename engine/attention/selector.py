"""Picks the attention backend for a device and dtype."""

from __future__ import annotations

import os

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from kernels.cpu_extension import cpu_kernels_apply, cpu_kernels_available

BACKENDS = ("auto", "torch", "cpu", "triton")


def make_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """``torch``: pure PyTorch (the reference). ``cpu``: the compiled kernel for every row, decode and prefill
    (float32 or bfloat16 on CPU). ``triton``: the Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``).
    ``auto``: ``triton`` on CUDA; on the CPU ``cpu`` where it applies and builds, else ``torch``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton attention backend needs CUDA (or TRITON_INTERPRET=1), not {device}")
        # Imported here: Triton reads TRITON_INTERPRET when the kernels are defined, and only this backend needs it.
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    cpu_applies = cpu_kernels_apply(device, dtype)
    if name == "cpu" and not cpu_applies:
        raise ValueError(f"the cpu attention backend needs float32 or bfloat16 on the CPU, not {dtype} on {device}")
    if name == "cpu" or (name == "auto" and cpu_applies and cpu_kernels_available()):
        return CpuAttentionBackend()
    return TorchAttentionBackend()
