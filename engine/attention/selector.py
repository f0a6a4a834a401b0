"""Picks the attention backend for a device and dtype."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from kernels.cpu_decode_attention import cpu_kernels_available, paged_decode_attention_cpu

BACKENDS = ("auto", "torch", "cpu")


def make_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """``torch``: pure PyTorch (the reference). ``cpu``: torch prefill + the compiled paged decode kernel
    (float32 on CPU). ``auto``: ``cpu`` where it applies and builds, else ``torch``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    cpu_applies = device.type == "cpu" and dtype == torch.float32
    if name == "cpu" and not cpu_applies:
        raise ValueError(f"the cpu attention backend needs float32 on the CPU, not {dtype} on {device}")
    if name == "cpu" or (name == "auto" and cpu_applies and cpu_kernels_available()):
        return TorchAttentionBackend(decode_kernel=paged_decode_attention_cpu)
    return TorchAttentionBackend()
