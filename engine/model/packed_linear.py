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


# The row counts the probe tries: every count up to 64 (where oneDNN's kernels change: on a CPU with AMX, bfloat16
# from 33 rows on), then the edges of larger blocks, up to the most rows one call is ever given.
PROBED_ROW_COUNTS = (*range(2, 65), 96, 127, 128, 129, 192, 255, 256)
# Each probe row holds +BIG and -BIG, whose products cancel exactly; every term summed while BIG sits in the
# float32 accumulator loses low bits to it, so any change in the order of the sums changes the result visibly
# (even after rounding to bfloat16), where ordinary random rows differ in one row of ten at most.
_PROBE_BIG = 2.0**16


@functools.cache
def probe_rows_per_call(in_features: int, out_features: int, has_bias: bool, dtype: torch.dtype) -> int:
    """The most rows one oneDNN matmul of this shape may be given with each row's result the same bits whatever the
    count, asked of oneDNN itself: it picks its kernel by the shape, and its kernels sum in different orders. On an
    Intel Xeon with AMX, bfloat16 changes kernel at 33 rows (float32 agrees at every probed count), so without
    slices a row's logits would depend on how many others ran in its step; on an AMD EPYC with AVX512-BF16 the
    tests found counts from two rows up to agree in both dtypes.
    (A single row always gets a kernel of its own: callers run it as two.) Once per shape and process, where batch
    invariance is asked for: 0.03-0.1 s, up to 0.7 s for the LM head in bfloat16 and 2.6 s in float32 (49,152 x
    576: each call reads 113 MB)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    weight[:, -1] = weight[:, 0]
    bias = torch.randn(out_features, generator=generator).to(dtype) if has_bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None)
    rows = torch.randn(PROBED_ROW_COUNTS[-1] + 1, in_features, generator=generator)
    rows[:, 0], rows[:, -1] = _PROBE_BIG, -_PROBE_BIG
    rows = rows.to(dtype)

    def multiply(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    alone: list[torch.Tensor] = []  # row i's result in a call of two rows
    agreed = PROBED_ROW_COUNTS[0]
    for count in PROBED_ROW_COUNTS:
        alone += [multiply(rows[row : row + 2])[0] for row in range(len(alone), count)]
        if not torch.equal(multiply(rows[:count]), torch.stack(alone)):
            break
        agreed = count
    return agreed


class _RowSlicedMatmul(nn.Module):
    """A packed layer that gives oneDNN only row counts whose kernels agree: a single row runs as two and the first
    is kept (oneDNN multiplies one row with another kernel than two or more, at K = 1536 and in the fused SwiGLU, in
    both dtypes; the extra row is nearly free where the weights' bandwidth sets the pace), and while
    ``batch_invariant`` more rows than ``invariant_rows_per_call`` (probed on first use) run in slices of that many.
    Each row's result is then the same whatever the batch around it (tests/engine/model/test_packed_linear.py), so
    a decode's logits do not depend on what else ran in its step."""

    batch_invariant = True  # per layer: set_batch_invariant()

    def _multiply(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """The bare oneDNN call(s) on every row given."""
        raise NotImplementedError

    def _probe(self) -> int:
        """``probe_rows_per_call()`` for this layer's matmuls."""
        raise NotImplementedError

    @functools.cached_property
    def invariant_rows_per_call(self) -> int:
        return self._probe()

    @property
    def rows_per_call(self) -> int | None:
        """The most rows one call takes; None: every row at once."""
        return self.invariant_rows_per_call if self.batch_invariant else None

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        rows, limit = x.shape[0], self.rows_per_call
        if rows == 1:
            return self._multiply(x.expand(2, -1), *(t.expand(2, -1) for t in rest))[:1]
        if limit is None or rows <= limit:
            return self._multiply(x, *rest)
        slices = [slice(start, start + limit) for start in range(0, rows, limit)]  # a last one of one row runs as two
        return torch.cat([self.forward(x[part], *(t[part] for t in rest)) for part in slices])


class PackedLinear(_RowSlicedMatmul):
    """``x @ weight.T + bias`` through oneDNN with the weight prepacked; holds no copy of the plain weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A plain attribute, not a parameter or buffer: an opaque oneDNN tensor cannot be saved, moved or copied.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.dtype = weight.dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _probe(self) -> int:
        return probe_rows_per_call(self.in_features, self.out_features, self.bias is not None, self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedSwiGLU(_RowSlicedMatmul):
    """``residual + down(silu(gate(x)) * up(x))``, Llama's MLP plus the residual, in three prepacked oneDNN
    matmuls whose element-wise work runs as fused post-ops on each output tile while it is in cache: SiLU
    (oneDNN's "swish") on the gate, times the gate on the up projection, plus the residual on the down one."""

    def __init__(self, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor) -> None:
        super().__init__()
        self.gate, self.up, self.down = (
            torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
            for w in (gate_weight, up_weight, down_weight)
        )
        (self.intermediate_size, self.hidden_size), self.dtype = up_weight.shape, up_weight.dtype

    def _multiply(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        gate = linear(x, self.gate, None, "swish", [], "")
        hidden = linear.binary(x, gate, self.up, None, "mul")
        return linear.binary(hidden, residual, self.down, None, "add")

    def _probe(self) -> int:
        # The element-wise work runs on finished output tiles, so the matmuls' kernels decide the sums' order.
        hidden, intermediate = self.hidden_size, self.intermediate_size
        return min(
            probe_rows_per_call(hidden, intermediate, False, self.dtype),
            probe_rows_per_call(intermediate, hidden, False, self.dtype),
        )


def set_batch_invariant(module: nn.Module, enabled: bool) -> int | None:
    """Every packed layer under ``module`` slices its rows so that a row's result does not depend on the batch
    (``enabled``; probes each shape not probed yet), or gives oneDNN every row at once (faster where its kernels
    change with the row count: on a CPU with AMX, in bfloat16; docs/benchmarks.md). Returns the fewest rows per
    call now in force, None for no limit."""
    layers = [layer for layer in module.modules() if isinstance(layer, _RowSlicedMatmul)]
    for layer in layers:
        layer.batch_invariant = enabled
    return min(layer.invariant_rows_per_call for layer in layers) if enabled and layers else None


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a ``PackedLinear``; returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.from_linear(child))
                replaced += 1
    return replaced
