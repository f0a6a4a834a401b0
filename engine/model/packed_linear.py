"""Linear layers whose weights are reordered once into oneDNN's blocked layout, for inference on the CPU.

``F.linear`` on the CPU goes to MKL's sgemm. On the machine we measure on (an AMD
EPYC with AVX-512), oneDNN's matmul on a prepacked weight (the op PyTorch's own
compiler uses for frozen CPU linears) runs this model's shapes at 183-226 GFLOP/s
from 64 rows up, where ``F.linear`` reaches 110-204, and at 1.25-3.1x its rate at 16 rows
(`scripts/bench_linear.py`, docs/benchmarks.md "Linear layers"). MKL's own packed-weight
API did not close the gap, so the packing is not the whole story: oneDNN's kernels are
simply faster here.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """True where oneDNN can run the model's linears: this torch has it, CPU, float32, or bfloat16 on a CPU whose
    instructions oneDNN's bfloat16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has neither)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or _cpu_packs_bfloat16()


@functools.cache
def _cpu_packs_bfloat16() -> bool:
    """Asked of oneDNN itself: it refuses to reorder a bfloat16 weight on a CPU without the instructions."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def _batch_invariant(matmul):
    """Runs a one-row input as two rows and keeps the first: oneDNN multiplies a single row with another kernel
    than two or more, whose sums round differently (at K = 1536, and in the fused SwiGLU, in both dtypes), so a
    decode's logits would depend on whether it ran alone in its step. From two rows up each row's result is the
    same whatever the batch (tests/engine/model/test_packed_linear.py); the extra row is nearly free where the
    weights' bandwidth sets the pace."""

    @functools.wraps(matmul)
    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1:
            return matmul(self, x, *rest)
        return matmul(self, x.expand(2, -1), *(t.expand(2, -1) for t in rest))[:1]

    return forward


class PackedLinear(nn.Module):
    """``x @ weight.T + bias`` through oneDNN with the weight prepacked; holds no copy of the plain weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A plain attribute, not a parameter or buffer: an opaque oneDNN tensor cannot be saved, moved or copied.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    @_batch_invariant
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedSwiGLU(nn.Module):
    """``residual + down(silu(gate(x)) * up(x))``, Llama's MLP plus the residual, in three prepacked oneDNN
    matmuls whose element-wise work runs as fused post-ops on each output tile while it is in cache: SiLU
    (oneDNN's "swish") on the gate, times the gate on the up projection, plus the residual on the down one."""

    def __init__(self, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor) -> None:
        super().__init__()
        self.gate, self.up, self.down = (
            torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
            for w in (gate_weight, up_weight, down_weight)
        )

    @_batch_invariant
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        gate = linear(x, self.gate, None, "swish", [], "")
        hidden = linear.binary(x, gate, self.up, None, "mul")
        return linear.binary(hidden, residual, self.down, None, "add")


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a ``PackedLinear``; returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.from_linear(child))
                replaced += 1
    return replaced
