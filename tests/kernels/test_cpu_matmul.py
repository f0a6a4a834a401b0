"""kvstorm's tile matmuls (on AMX or AVX512-BF16, whichever this CPU has) against float64 products of the same
bfloat16 values: each result within one bfloat16 rounding of the exact value, and each row's result the same bits
whatever the call's row count and the row's place in it. Where the CPU (or the build) has neither, the engine never
calls them: the tests say so and stop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_isa import visible_cpu_flags
from kernels.cpu_matmul import (
    interleave_column_tiles,
    pack_tiles,
    tile_linear,
    tile_matmul_applies,
    tile_matmul_isa,
    tile_swiglu,
)


def test_the_kernels_run_on_amx_where_the_cpu_has_it_else_on_avx512_bf16_else_not_at_all():
    flags = visible_cpu_flags()
    expected = "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512-bf16" if "avx512_bf16" in flags else None
    assert tile_matmul_isa() == expected


needs_tiles = pytest.mark.skipif(
    tile_matmul_isa() is None, reason="this CPU has neither AMX nor AVX512-BF16; the engine multiplies with oneDNN"
)

# The model's shapes (in, out): attention's fused QKV and output projections, the MLP's halves, the LM head.
SHAPES = [(576, 960), (576, 576), (1536, 576), (576, 49152)]


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)


def _assert_one_rounding_from(got: torch.Tensor, exact: torch.Tensor) -> None:
    """Float32 sums of exact products, rounded once to bfloat16: within an 8-bit mantissa's half step of the exact
    value, plus the float32 sums' own error."""
    assert got.dtype == torch.bfloat16
    error = (got.double() - exact).abs()
    allowed = exact.abs() * 2**-8 + 1e-4 * exact.abs().max()
    assert (error <= allowed).all(), (error - allowed).max().item()


@needs_tiles
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("extras", ["none", "bias", "residual"])
def test_linear_is_the_product_rounded_once(shape, extras):
    in_features, out_features = shape
    rows = 300 if out_features < 10_000 else 40
    weight, x = _bf16(out_features, in_features, seed=1, scale=0.05), _bf16(rows, in_features, seed=2)
    bias = _bf16(out_features, seed=3) if extras == "bias" else None
    residual = _bf16(rows, out_features, seed=4) if extras == "residual" else None
    exact = x.double() @ weight.double().T
    exact += 0 if bias is None else bias.double()
    exact += 0 if residual is None else residual.double()
    _assert_one_rounding_from(tile_linear(x, pack_tiles(weight), bias, residual), exact)


@needs_tiles
@pytest.mark.parametrize("extras", ["none", "bias", "residual"])
def test_linear_into_float32_is_the_sums_unrounded(extras):
    """The LM head's logits: the float32 sums as they are, which round to the bfloat16 result bit for bit."""
    weight, x = _bf16(49152, 576, seed=1, scale=0.05), _bf16(5, 576, seed=2)
    bias = _bf16(49152, seed=3) if extras == "bias" else None
    residual = _bf16(5, 49152, seed=4) if extras == "residual" else None
    exact = x.double() @ weight.double().T
    exact += 0 if bias is None else bias.double()
    exact += 0 if residual is None else residual.double()
    packed = pack_tiles(weight)
    got = tile_linear(x, packed, bias, residual, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert torch.equal(got.to(torch.bfloat16), tile_linear(x, packed, bias, residual))


@needs_tiles
def test_swiglu_is_the_gated_product_rounded_once():
    gate, up = _bf16(1536, 576, seed=5, scale=0.05), _bf16(1536, 576, seed=6, scale=0.05)
    x = _bf16(100, 576, seed=7)
    x64 = x.double()
    exact = F.silu(x64 @ gate.double().T) * (x64 @ up.double().T)
    _assert_one_rounding_from(tile_swiglu(x, interleave_column_tiles(pack_tiles(gate), pack_tiles(up))), exact)


@needs_tiles
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_a_row_is_the_same_bits_in_a_call_of_any_row_count_at_any_place(shape):
    in_features, out_features = shape
    weight, bias = _bf16(out_features, in_features, seed=8, scale=0.05), _bf16(out_features, seed=9)
    x, residual = _bf16(600, in_features, seed=10), _bf16(600, out_features, seed=11)
    gate, up = _bf16(960, in_features, seed=12, scale=0.05), _bf16(960, in_features, seed=13)
    gate_up = interleave_column_tiles(pack_tiles(gate), pack_tiles(up))
    packed = pack_tiles(weight)
    linear = tile_linear(x, packed, bias, residual)
    swiglu = tile_swiglu(x, gate_up)
    # Counts around AMX's tiles of 16 and 32 rows and its 256-row chunks, AVX512-BF16's blocks of 12 rows and its
    # chunks (216 rows of 576 inputs, 84 of 1536); the rows starting anywhere, and strided (every other row of a
    # wider tensor, as a view of a fused projection's output gives them).
    for count in (1, 2, 11, 12, 13, 15, 16, 17, 31, 32, 33, 84, 85, 100, 216, 217, 255, 256, 257, 600):
        for start in {0, 5, 600 - count}:
            part = slice(start, start + count)
            assert torch.equal(tile_linear(x[part], packed, bias, residual[part]), linear[part]), (count, start)
            assert torch.equal(tile_swiglu(x[part], gate_up), swiglu[part]), (count, start)
    strided = torch.stack([x, torch.zeros_like(x)], dim=1).flatten(0, 1)[::2]
    assert strided.stride(0) == 2 * in_features
    assert torch.equal(tile_linear(strided, packed, bias, residual), linear)


@needs_tiles
def test_no_rows_give_no_rows():
    weight = _bf16(64, 32, seed=14)
    assert tile_linear(torch.empty(0, 32, dtype=torch.bfloat16), pack_tiles(weight)).shape == (0, 64)


@needs_tiles
def test_shapes_the_tiles_cannot_hold_are_refused_with_their_sizes():
    assert tile_matmul_applies(576, 960, torch.bfloat16)
    assert not tile_matmul_applies(80, 96, torch.bfloat16)  # inputs not in 32s
    assert not tile_matmul_applies(96, 80, torch.bfloat16)  # outputs not in pairs of 16
    assert not tile_matmul_applies(576, 960, torch.float32)
    with pytest.raises(RuntimeError, match=r"weight \[96, 80\]: N a multiple of 16, K of 32"):
        pack_tiles(_bf16(96, 80, seed=15))
    packed = pack_tiles(_bf16(64, 64, seed=16))
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        tile_linear(_bf16(3, 32, seed=17), packed)
    with pytest.raises(RuntimeError, match="bias and residual: bfloat16 with 64 dense columns"):
        tile_linear(_bf16(3, 64, seed=18), packed, bias=_bf16(32, seed=19))
