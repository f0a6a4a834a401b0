"""The compiled argmax against torch.argmax: ties go to the first index, a NaN wins, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_argmax import argmax_rows_cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch_on_logits_with_ties_nans_and_infinities(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 49152, generator=generator) * 4).to(dtype)
    # bfloat16 rounds many logits to equal values: ties between the largest ones are common there; here forced too.
    logits[1, [7, 30000, 49151]] = 100.0
    logits[2, 11] = float("nan")
    logits[2, 20] = float("nan")
    logits[3] = float("-inf")
    logits[4, 5] = float("inf")
    logits[5, -1] = 1000.0  # the last column
    logits[6] = 0.0
    expected = logits.argmax(dim=-1)
    assert expected[[1, 2, 3, 5, 6]].tolist() == [7, 11, 0, 49151, 0]
    assert torch.equal(argmax_rows_cpu(logits), expected)


def test_argmax_of_one_row_and_of_a_non_contiguous_batch():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(argmax_rows_cpu(logits[:1]), logits[:1].argmax(dim=-1))
    assert torch.equal(argmax_rows_cpu(logits[::2]), logits[::2].argmax(dim=-1))
