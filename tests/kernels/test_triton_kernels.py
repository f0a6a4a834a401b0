"""Every Triton kernel against its torch reference (and attention against float64), run by Triton's interpreter.

The cases live in ``kernels.check`` so the GPU run (``scripts/gpu_check.sh``) checks with the same code on
realistic shapes; here they are small, since the interpreter runs each program in Python.
"""

from __future__ import annotations

import pytest
import torch

from kernels.check import interpreter_checks
from kernels.triton_paged_attention import paged_decode_attention

CHECKS = interpreter_checks()


@pytest.mark.parametrize("check", CHECKS, ids=[f"{c.func.__name__}-{i}" for i, c in enumerate(CHECKS)])
def test_kernel_matches_its_reference_within_the_bound(check):
    result = check()
    assert result.passed, result


def test_kernels_reject_caches_they_cannot_address():
    cache = torch.randn(4, 4, 2, 32)
    q = torch.randn(1, 2, 32)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="share shape and strides"):
        paged_decode_attention(q, cache, cache[:, :2], tables, lens, 1.0)
    odd = torch.randn(4, 4, 2, 24)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_decode_attention(torch.randn(1, 2, 24), odd, odd, tables, lens, 1.0)
