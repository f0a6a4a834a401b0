"""The compiled CPU RMSNorm and rotary kernels against the model's pure-torch versions: the same roundings (the
rotation in bfloat16 bit for bit; the norm's float32 sums in another order, so a rare last bit), and one row's
result whatever the rows around it."""

from __future__ import annotations

import pytest
import torch

from engine.model.llama import RotaryEmbedding, rms_norm, rotate_heads_
from kernels.cpu_layer_ops import rms_norm_cpu, rotate_heads_cpu_


def _rows(num_rows: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (3 * torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [576, 77])
def test_rms_norm_kernel_rounds_as_the_reference_does(dtype, dim):
    x = _rows(300, dim, dtype)
    weight = _rows(1, dim, dtype, seed=1)[0]
    expected = rms_norm(x, weight, 1e-5)
    got = rms_norm_cpu(x, weight, 1e-5)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # the float32 sums differ in order only: a bfloat16 result may differ by its last bit, and rarely
        differing = (got != expected).sum().item()
        assert differing <= x.numel() // 1000, differing
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_rotates_query_and_key_heads_in_place_as_the_reference_does(dtype):
    num_heads, head_dim, width = 12, 64, 15 * 64  # 9 query + 3 key heads, then 3 value heads left alone
    positions = torch.randint(0, 8192, (200,), generator=torch.Generator().manual_seed(2))
    cos, sin = RotaryEmbedding(head_dim, 100000.0)(positions, dtype)
    qkv = _rows(200, width, dtype)
    expected = qkv.clone()
    rotate_heads_(expected, cos, sin, num_heads, head_dim)
    got = qkv.clone()
    rotate_heads_cpu_(got, cos, sin, num_heads, head_dim)
    assert torch.equal(got[:, num_heads * head_dim :], qkv[:, num_heads * head_dim :])
    assert not torch.equal(got, qkv)
    if dtype == torch.bfloat16:  # products of bfloat16 values are exact in float32: nothing left to differ
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_comes_out_the_same_alone_and_among_others(dtype):
    """Batch invariance: a decode's row is normalised and rotated bit for bit as in a prefill chunk of 100."""
    x = _rows(100, 576, dtype)
    weight = _rows(1, 576, dtype, seed=1)[0]
    together = rms_norm_cpu(x, weight, 1e-5)
    assert all(torch.equal(rms_norm_cpu(x[i : i + 1], weight, 1e-5), together[i : i + 1]) for i in (0, 41, 99))
    cos, sin = RotaryEmbedding(64, 10000.0)(torch.arange(100), dtype)
    qkv = _rows(100, 15 * 64, dtype, seed=3)
    rotated = qkv.clone()
    rotate_heads_cpu_(rotated, cos, sin, 12, 64)
    for i in (0, 41, 99):
        alone = qkv[i : i + 1].clone()
        rotate_heads_cpu_(alone, cos[i : i + 1], sin[i : i + 1], 12, 64)
        assert torch.equal(alone, rotated[i : i + 1])
