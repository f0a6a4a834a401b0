"""kvstorm's own bfloat16 matmuls for the model's linear layers (``kernels/csrc/tile_matmul.cpp``), on Intel's AMX
tiles or on AVX512-BF16's pair dot products (AMD EPYC from Zen 4 on), weights packed once in AMX's tile layout.

Each output element is one chain of pair products over the inputs in a fixed order, so a row's result is the same
bits in a call of any row count: batch-invariant by construction, with no probing, padding or slicing (oneDNN's
kernels change their order of sums with the row count). A lone decode row streams its weights from memory near the
bandwidth, where oneDNN's kernels ran at two thirds of it or less (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu_extension import compiled_kernels, cpu_kernels_available

# A packed weight is tiles of this many output columns by TILE_DEPTH inputs; a call multiplies two column tiles at a
# time, so the kernels take layers whose outputs are a multiple of 2 * TILE_COLUMNS.
TILE_COLUMNS = 16
TILE_DEPTH = 32


@functools.cache
def tile_matmul_isa() -> str | None:
    """What the matmuls run on in this process: "amx" (a CPU with AMX-BF16, e.g. Intel Xeon from Sapphire Rapids on,
    whose tile state the OS grants), "avx512-bf16" (e.g. AMD EPYC from Zen 4 on), or None where the CPU kernels did
    not build for either (the engine multiplies with oneDNN there)."""
    return (cpu_kernels_available() and compiled_kernels().tile_matmul_isa()) or None


def tile_matmul_applies(in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Whether a layer of this shape and dtype runs on the tile matmuls here."""
    shape_fits = in_features % TILE_DEPTH == 0 and out_features % (2 * TILE_COLUMNS) == 0
    return dtype == torch.bfloat16 and shape_fits and tile_matmul_isa() is not None


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in tiles [out / 16, in / 32, 16, 32] (a plain bfloat16 tensor)."""
    return compiled_kernels().tile_pack_weight(weight.detach())


def interleave_column_tiles(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gate and up weights, each packed by ``pack_tiles``, as one: each gate tile followed by the up tile of the
    same 16 outputs, so that ``tile_swiglu`` multiplies the two together and finishes ``silu(gate) * up`` while both
    are in registers."""
    return torch.stack([gate, up], dim=1).flatten(0, 1)


def tile_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` for bfloat16 ``x`` [rows, in], summed in float32 and rounded once to
    ``out_dtype`` (bfloat16; float32 keeps the sums as they are, as the LM head's logits need)."""
    out = torch.empty(x.shape[0], packed.shape[0] * TILE_COLUMNS, dtype=out_dtype)
    compiled_kernels().tile_linear(
        out, _dense_rows(x), packed, bias, None if residual is None else _dense_rows(residual)
    )
    return out


def tile_swiglu(x: torch.Tensor, packed_gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for bfloat16 ``x`` [rows, in], in float32 and rounded once."""
    out = torch.empty(x.shape[0], packed_gate_up.shape[0] // 2 * TILE_COLUMNS, dtype=torch.bfloat16)
    compiled_kernels().tile_swiglu(out, _dense_rows(x), packed_gate_up)
    return out


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
