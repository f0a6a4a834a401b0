"""Linear layers whose weights are reordered once into oneDNN's blocked layout, or into tiles for kvstorm's own
kernels (bfloat16 on a CPU with AMX or AVX512-BF16: ``kernels.cpu_matmul``), for inference on the CPU.

``F.linear`` on the CPU goes to MKL's sgemm. On the machine we measure on (an AMD
EPYC with AVX-512), oneDNN's matmul on a prepacked weight (the op PyTorch's own
compiler uses for frozen CPU linears) runs this model's shapes at 183-226 GFLOP/s
from 64 rows up, where ``F.linear`` reaches 110-204, and at 1.25-3.1x its rate at 16 rows
(`kvstorm bench linear`, docs/benchmarks.md). MKL's own packed-weight
API did not close the gap, so the packing is not the whole story: oneDNN's kernels are
simply faster here.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch
from torch import nn

from engine.core.config import check_invariant_rows, check_matmul_kernel
from engine.cpu_share import thread_levels
from kernels.cpu_matmul import (
    interleave_column_tiles,
    pack_tiles,
    tile_linear,
    tile_matmul_applies,
    tile_matmul_isa,
    tile_swiglu,
)

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


# How a prepacked weight is laid out, by the batch size oneDNN is told to expect: "batch" (its default, for calls of
# many rows) or "vector" (for one row). On an Intel Xeon with AMX in bfloat16 the kernels of a "vector" weight sum
# in the same order at every row count the probe tries (1-256; the MLP's down projection, K = 1536: 1-144), where a
# "batch" weight's change at 33 rows.
WEIGHT_LAYOUTS = {"batch": None, "vector": 1}
# The layout of a layer packed for kvstorm's tile matmuls instead (``kernels.cpu_matmul``): batch-invariant at any
# row count by construction, so its calls are never padded or sliced.
TILE_LAYOUT = "tiles"


def uses_tiles(in_features: int, out_features: int, dtype: torch.dtype, kernel: str) -> bool:
    """Whether a layer of this shape packs for the tile matmuls when asked for ``kernel`` (``MATMUL_KERNELS``):
    "auto" wherever they apply."""
    check_matmul_kernel(kernel)
    return kernel == "auto" and tile_matmul_applies(in_features, out_features, dtype)


def _prepack(weight: torch.Tensor, layout: str = "batch") -> torch.Tensor:
    """The weight reordered into oneDNN's blocked ``layout`` for this CPU (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), WEIGHT_LAYOUTS[layout])


# The most rows one call is ever given (the probe's last count; more run in slices).
MOST_ROWS_PER_CALL = 256
# Calls of more rows than this are padded up to a multiple of it, so a layer sees few row counts. oneDNN compiles and
# caches kernels per shape and row count: calls of every count from 33 to 255 of the model's five bfloat16 shapes grew
# a process by 0.55 GiB on a CPU with AMX. AMX multiplies 16 rows per tile, so the padding costs it little; smaller
# counts, where a decode's latency is, stay as they are.
ROW_GRANULE = 16
# Each probe row holds +BIG and -BIG, whose products cancel exactly; every term summed while BIG sits in the
# float32 accumulator loses low bits to it, so any change in the order of the sums changes the result visibly
# (even after rounding to bfloat16), where ordinary random rows differ in one row of ten at most.
_PROBE_BIG = 2.0**16


class RowRange(NamedTuple):
    """Row counts one matmul call may be given: fewer rows are padded up to ``fewest``, more run in slices."""

    fewest: int
    most: int

    @property
    def width(self) -> int:
        return self.most - self.fewest

    def padded(self, rows: int) -> int:
        """The rows a call of ``rows`` (at most ``most``) is given: ``fewest`` for as many or fewer, else ``rows`` up
        to ``ROW_GRANULE`` and beyond it the next multiple of it (or ``most``)."""
        if rows <= self.fewest:
            return self.fewest
        if rows <= ROW_GRANULE:
            return rows
        return min(-(-rows // ROW_GRANULE) * ROW_GRANULE, self.most)


def probed_row_counts(fewest: int) -> list[int]:
    """The row counts the calls of a range that starts at ``fewest`` are given (``RowRange.padded``), in order."""
    return sorted({RowRange(fewest, MOST_ROWS_PER_CALL).padded(rows) for rows in range(1, MOST_ROWS_PER_CALL + 1)})


class _ProbedMatmul:
    """One matmul shape as the probe multiplies it: rows that expose any change in the order of the sums."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        has_bias: bool,
        dtype: torch.dtype,
        layout: str,
        thread_counts: tuple[int, ...],
    ) -> None:
        self.thread_counts = thread_counts
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=generator)
        weight[:, -1] = weight[:, 0]
        self.bias = torch.randn(out_features, generator=generator).to(dtype) if has_bias else None
        self.packed = _prepack(weight.to(dtype), layout)
        rows = torch.randn(2 * MOST_ROWS_PER_CALL, in_features, generator=generator)
        rows[:, 0], rows[:, -1] = _PROBE_BIG, -_PROBE_BIG
        self.rows = rows.to(dtype)
        self.alone: list[torch.Tensor] = []  # row i's result first in a call of `fewest` rows

    def multiply(self, count: int, first: int = 0) -> torch.Tensor:
        x = self.rows[first : first + count]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def agrees(self, fewest: int, count: int) -> bool:
        """Whether a call of ``count`` rows gives each row what it gets first in a call of ``fewest``, on each of
        ``thread_counts`` threads (the first: this thread's count now)."""
        # Cloned: a view would keep its whole call's output alive (for the LM head, 3 MB a row).
        self.alone += [self.multiply(fewest, first=row)[0].clone() for row in range(len(self.alone), count)]
        expected = torch.stack(self.alone[:count])
        try:
            for threads in self.thread_counts:
                torch.set_num_threads(threads)
                if not torch.equal(self.multiply(count), expected):
                    return False
            return True
        finally:
            torch.set_num_threads(self.thread_counts[0])


def probe_row_ranges(
    in_features: int, out_features: int, has_bias: bool, dtype: torch.dtype, layout: str = "batch"
) -> tuple[RowRange, ...]:
    """``_probe_row_ranges`` at every thread count the engine may run on from the calling thread's count
    (``engine.cpu_share.thread_levels``): a co-tenant that changes the count changes no result."""
    thread_counts = thread_levels(torch.get_num_threads())
    return _probe_row_ranges(in_features, out_features, has_bias, dtype, layout, thread_counts)


@functools.cache
def _probe_row_ranges(
    in_features: int,
    out_features: int,
    has_bias: bool,
    dtype: torch.dtype,
    layout: str,
    thread_counts: tuple[int, ...],
) -> tuple[RowRange, ...]:
    """Every range of row counts whose oneDNN kernels agree for this matmul shape and weight layout, for calls
    padded as ``RowRange.padded`` pads them: a row's result is the same bits at any position of a call of any count
    the range gives, on any of ``thread_counts`` threads, asked of oneDNN itself (it picks its kernel by the shape
    and the threads, and its kernels sum in different orders). On an Intel Xeon with AMX, bfloat16 gives 1-32 and
    33-256 (the MLP's down projection, K = 1536: 1-32, then 33 to 36 one count each, and 37-240), and with the
    "vector" layout (``WEIGHT_LAYOUTS``) 1-256 (the down projection: 1-144); in float32 a lone row has a kernel of
    its own at K = 1536, then 2-256 agree; on an AMD EPYC with AVX512-BF16 the tests found counts from two rows up to
    agree in both dtypes, on 2 threads and on 1. Once per shape, layout and process, where batch invariance is asked
    for: on one thread count 0.1-0.3 s, about 1 s for the LM head (49,152 x 576: each call reads 57 MB in
    bfloat16), 1.6 s in float32; each other count costs its calls again."""
    matmul = _ProbedMatmul(in_features, out_features, has_bias, dtype, layout, thread_counts)
    ranges: list[RowRange] = []
    fewest = 1
    while MOST_ROWS_PER_CALL - fewest > max((r.width for r in ranges), default=-1):  # or no wider one is left
        matmul.alone = []
        agreed = 0
        for count in probed_row_counts(fewest):
            if not matmul.agrees(fewest, count):
                break
            agreed = count
        if agreed:
            ranges.append(RowRange(fewest, agreed))
        fewest = max(fewest, agreed) + 1
    return tuple(ranges)


@functools.cache  # asked on every call of every layer: a lookup, not a search
def choose_row_range(ranges: tuple[RowRange, ...], favour: str) -> RowRange:
    """``throughput``: the widest of ``ranges``, so that big batches run in few calls; ``latency``: the first that
    spans at least ``ROW_GRANULE`` counts, so that a lone decode runs as one row or two (a range of a lone row only,
    as float32 has at K = 1536, would cut every batch into single rows). A single count always agrees with itself,
    so there is a range."""
    check_invariant_rows(favour)
    if favour == "latency":
        return next((r for r in ranges if r.width >= ROW_GRANULE), max(ranges, key=lambda r: r.width))
    return max(ranges, key=lambda r: (r.width, -r.fewest))


def choose_layout(in_features: int, out_features: int, has_bias: bool, dtype: torch.dtype, favour: str) -> str:
    """The weight layout for batch-invariant calls that favour ``favour`` (``choose_row_range``): ``throughput``
    keeps oneDNN's layout for batches (its kernels run big batches fastest); ``latency`` takes the layout whose range
    for a lone decode starts lowest and then spans most counts (probing both). On an Intel Xeon with AMX in bfloat16
    that is "vector": a lone row runs alone and batches run in calls of up to 144-256 rows, where the batch layout's
    range for lone rows ends at 32."""
    check_invariant_rows(favour)
    if favour == "throughput":
        return "batch"

    def lone_row_range(layout: str) -> tuple[int, int]:
        chosen = choose_row_range(probe_row_ranges(in_features, out_features, has_bias, dtype, layout), favour)
        return -chosen.fewest, chosen.width

    return max(WEIGHT_LAYOUTS, key=lone_row_range)  # on a tie the first, "batch"


class _RowSlicedMatmul(nn.Module):
    """A packed layer (one matmul shape ``in_features`` -> ``out_features``, called once or more per forward) that
    gives oneDNN only row counts whose kernels agree, while ``batch_invariant``: the range of them ``favour`` picks
    (``invariant_row_range``, probed on first use). Fewer rows are padded up to its fewest (a lone row runs as two
    where it has a kernel of its own; on an Intel Xeon with AMX in bfloat16, as 33 or 37 rows for throughput, a
    fifth slower than one row, while 128 rows run in a call where slices of 32 took twice as long), counts above
    ``ROW_GRANULE`` up to a multiple of it, more than its most run in slices. Each row's result is then the same
    whatever the batch around it (tests/engine/model/test_packed_linear.py), so a decode's logits do not depend on
    what else ran in its step. A layer packed for kvstorm's tile matmuls (``TILE_LAYOUT``) takes every row at once:
    they are invariant at any row count."""

    batch_invariant = True  # per layer: set_batch_invariant()
    favour = "throughput"  # per layer: set_batch_invariant()
    in_features: int
    out_features: int
    dtype: torch.dtype
    has_bias = False
    layout = "batch"  # of the packed weights (WEIGHT_LAYOUTS), fixed when they are packed

    def _pack(self, weight: torch.Tensor, favour: str, kernel: str) -> torch.Tensor:
        """``weight`` packed for the tile matmuls where this layer's shape takes them (``uses_tiles``), else for
        oneDNN in the layout ``favour`` picks (``choose_layout``); ``self.layout`` says which."""
        if uses_tiles(self.in_features, self.out_features, self.dtype, kernel):
            self.layout = TILE_LAYOUT
            return pack_tiles(weight)
        self.layout = choose_layout(self.in_features, self.out_features, self.has_bias, self.dtype, favour)
        return _prepack(weight, self.layout)

    def _multiply(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """The bare kernel call(s) on every row given: oneDNN's, or the tile matmuls' for ``TILE_LAYOUT``."""
        raise NotImplementedError

    @functools.cached_property
    def invariant_row_ranges(self) -> tuple[RowRange, ...]:
        # Element-wise work fused into a call runs on finished output tiles, so the kernel decides the sums' order.
        return probe_row_ranges(self.in_features, self.out_features, self.has_bias, self.dtype, self.layout)

    @property
    def invariant_row_range(self) -> RowRange:
        return choose_row_range(self.invariant_row_ranges, self.favour)

    @property
    def row_range(self) -> RowRange | None:
        """The row counts one call takes; None: every row at once (the tile matmuls' calls are invariant at any)."""
        return self.invariant_row_range if self.batch_invariant and self.layout != TILE_LAYOUT else None

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        rows, row_range = x.shape[0], self.row_range
        if row_range is None:
            return self._multiply(x, *rest)
        if rows > row_range.most:
            slices = [slice(start, start + row_range.most) for start in range(0, rows, row_range.most)]
            return torch.cat([self.forward(x[part], *(t[part] for t in rest)) for part in slices])
        padded_rows = row_range.padded(rows)
        if padded_rows == rows:
            return self._multiply(x, *rest)
        inputs = (_PADDING.rows_then_padding(slot, t, padded_rows) for slot, t in enumerate((x, *rest)))
        return self._multiply(*inputs)[:rows]


class _PaddingBuffers(threading.local):
    """Where a padded call's arguments are copied: one buffer of ``MOST_ROWS_PER_CALL`` rows per argument position,
    width and dtype, per thread. Each output row of a matmul (and of its fused element-wise work) depends only on
    its own input row, so the padding rows can hold whatever earlier calls left there: copying into a kept buffer
    saves allocating and zeroing a padded copy on every call (one stream's decode step: about 1.5 ms of 25, on a
    CPU with AMX in bfloat16; docs/benchmarks.md)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def rows_then_padding(self, slot: int, rows: torch.Tensor, padded_rows: int) -> torch.Tensor:
        key = (slot, rows.shape[1], rows.dtype)
        if key not in self.by_key:
            # A normal tensor even when first asked for under inference mode (as the engine runs): an inference
            # tensor could not be written outside it.
            with torch.inference_mode(False):
                self.by_key[key] = torch.zeros(MOST_ROWS_PER_CALL, rows.shape[1], dtype=rows.dtype)
        buffer = self.by_key[key]
        buffer[: rows.shape[0]].copy_(rows)
        return buffer[:padded_rows]


_PADDING = _PaddingBuffers()


class PackedLinear(_RowSlicedMatmul):
    """``x @ weight.T + bias`` through oneDNN or the tile matmuls with the weight prepacked; holds no copy of the
    plain weight. ``float32_output``: a bfloat16 layer's result in float32, not rounded to bfloat16 (the LM head: a
    logit of about 25 rounded to bfloat16 moves by up to 1/16, so a near-tie between two tokens in float32 becomes
    an exact tie or flips; see ``_multiply``)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        favour: str = "throughput",
        kernel: str = "auto",
        float32_output: bool = False,
    ) -> None:
        super().__init__()
        (self.out_features, self.in_features), self.dtype = weight.shape, weight.dtype
        self.float32_output = float32_output and weight.dtype != torch.float32
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # A plain attribute, not a parameter or buffer: an opaque oneDNN tensor cannot be saved, moved or copied.
        self.packed_weight = self._pack(weight, favour, kernel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, favour: str = "throughput", kernel: str = "auto") -> PackedLinear:
        return cls(linear.weight, linear.bias, favour, kernel)

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == TILE_LAYOUT:
            out_dtype = torch.float32 if self.float32_output else x.dtype
            return tile_linear(x, self.packed_weight, self.bias, out_dtype=out_dtype)
        rounded = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        if not self.float32_output:
            return rounded
        # oneDNN's bfloat16 matmul only gives bfloat16: a second pass subtracts the rounded result from the float32
        # sums in a fused post-op, so the (at most half an ulp) rounding error comes back, itself rounded to 8 bits.
        # The sum of the two is the float32 result to about 16 bits, for twice the matmul's time.
        error = torch.ops.mkldnn._linear_pointwise.binary(x, rounded, self.packed_weight, self.bias, "sub")
        return rounded.float() + error.float()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
            f"layout={self.layout}"
        )


class _SwiGLUInput(_RowSlicedMatmul):
    """``silu(gate(x)) * up(x)``: with oneDNN two matmuls of one shape, SiLU (oneDNN's "swish") fused into the
    first, the product into the second; with the tile matmuls one pass over x, gate and up tiles side by side."""

    def __init__(self, gate_weight: torch.Tensor, up_weight: torch.Tensor, favour: str, kernel: str) -> None:
        super().__init__()
        (self.out_features, self.in_features), self.dtype = up_weight.shape, up_weight.dtype
        gate, up = (self._pack(w, favour, kernel) for w in (gate_weight, up_weight))
        if self.layout == TILE_LAYOUT:
            self.gate_up = interleave_column_tiles(gate, up)
        else:
            self.gate, self.up = gate, up

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == TILE_LAYOUT:
            return tile_swiglu(x, self.gate_up)
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up, None, "mul")


class _ResidualDown(_RowSlicedMatmul):
    """``residual + down(hidden)``, the sum fused into the matmul."""

    def __init__(self, down_weight: torch.Tensor, favour: str, kernel: str) -> None:
        super().__init__()
        (self.out_features, self.in_features), self.dtype = down_weight.shape, down_weight.dtype
        self.down = self._pack(down_weight, favour, kernel)

    def _multiply(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.layout == TILE_LAYOUT:
            return tile_linear(hidden, self.down, residual=residual)
        return torch.ops.mkldnn._linear_pointwise.binary(hidden, residual, self.down, None, "add")


class PackedSwiGLU(nn.Module):
    """``residual + down(silu(gate(x)) * up(x))``, Llama's MLP plus the residual, in three prepacked oneDNN
    matmuls whose element-wise work runs as fused post-ops on each output tile while it is in cache. The two halves
    take their row counts apart: on an Intel Xeon with AMX in bfloat16, the gate and up projections (K = 576) agree
    from 33 rows on, the down projection (K = 1536) from 37, and a 37-row call of the gate or up projection costs
    a fifth more than a 33-row one."""

    def __init__(
        self,
        gate_weight: torch.Tensor,
        up_weight: torch.Tensor,
        down_weight: torch.Tensor,
        favour: str = "throughput",
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.swiglu = _SwiGLUInput(gate_weight, up_weight, favour, kernel)
        self.residual_down = _ResidualDown(down_weight, favour, kernel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.residual_down(self.swiglu(x), residual)


def set_batch_invariant(module: nn.Module, enabled: bool, favour: str = "throughput") -> RowRange | None:
    """Every packed layer under ``module`` pads and slices its rows so that a row's result does not depend on the
    batch (``enabled``; probes each shape not probed yet), in the range of row counts ``favour`` picks
    (``choose_row_range``), or gives oneDNN every row at once (faster where its kernels change with the row count:
    on a CPU with AMX, in bfloat16; docs/benchmarks.md). Returns the row counts every layer's range holds (the
    highest fewest, the lowest most: a batch of fewer rows is padded in some layer, of more sliced), None for no
    limit."""
    layers = [layer for layer in module.modules() if isinstance(layer, _RowSlicedMatmul)]
    check_invariant_rows(favour)  # before any layer changes
    for layer in layers:
        layer.batch_invariant, layer.favour = enabled, favour
    ranges = [layer.row_range for layer in layers if layer.row_range is not None]
    if not ranges:
        return None
    return RowRange(max(r.fewest for r in ranges), min(r.most for r in ranges))


def tile_matmul_name() -> str:
    """kvstorm's tile matmuls as startup lines and benchmarks name them: "kvstorm-amx" or "kvstorm-avx512-bf16"."""
    return f"kvstorm-{tile_matmul_isa()}"


def describe_packed_matmuls(module: nn.Module, batch_invariant: bool, rows: RowRange | None) -> str:
    """What multiplies the packed layers under ``module`` (``tile_matmul_name()``, "onednn-packed" or both) and,
    where batch invariance is asked for, in calls of how many rows (``set_batch_invariant``'s ``rows``)."""
    layouts = {layer.layout for layer in module.modules() if isinstance(layer, _RowSlicedMatmul)}
    used = [(TILE_LAYOUT in layouts, tile_matmul_name()), (bool(layouts - {TILE_LAYOUT}), "onednn-packed")]
    kernels = " and ".join(name for in_use, name in used if in_use)
    if not batch_invariant:
        return kernels
    if rows is None:
        return f"{kernels}, batch-invariant at any row count"
    return f"{kernels}, batch-invariant in calls of {rows.fewest}-{rows.most} rows"


def pack_linear_layers(module: nn.Module, favour: str = "throughput", kernel: str = "auto") -> int:
    """Replace every ``nn.Linear`` under ``module`` by a ``PackedLinear`` for ``kernel`` (``uses_tiles``), oneDNN's
    in the layout ``favour`` picks (``choose_layout``); returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.from_linear(child, favour, kernel))
                replaced += 1
    return replaced
