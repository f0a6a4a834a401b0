"""The compiled CPU paged decode kernel against its torch reference and a float64 dense computation."""

from __future__ import annotations

import pytest
import torch

from kernels.check import dense_float64
from kernels.cpu_decode_attention import paged_decode_attention_cpu
from kernels.reference import paged_decode_attention_reference


def make_case(seed: int, num_seqs: int, num_heads: int, num_kv_heads: int, block_size: int, max_len: int):
    generator = torch.Generator().manual_seed(seed)
    head_dim = 64
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=generator)
    max_blocks = int(-(-seq_lens.max() // block_size))
    num_blocks = num_seqs * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    # Random, non-overlapping block tables; slots past a sequence's length hold unrelated data.
    order = torch.randperm(num_blocks, generator=generator)[: num_seqs * max_blocks]
    block_tables = order.view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    return q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5


def dense_float64_decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Each sequence's one query over its context, in float64."""
    outputs = []
    for i, seq_len in enumerate(seq_lens.tolist()):
        keys, values = (c[block_tables[i]].flatten(0, 1)[:seq_len] for c in (k_cache, v_cache))
        outputs.append(dense_float64(q[i : i + 1], keys, values, scale))
    return torch.cat(outputs)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2), (32, 8)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_kernel_matches_reference_and_float64(num_heads, num_kv_heads, block_size, seed):
    case = make_case(
        seed, num_seqs=5, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size, max_len=90
    )
    out = paged_decode_attention_cpu(*case)
    expected = dense_float64_decode(*case)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5), (out.double() - expected).abs().max()
    assert torch.allclose(out, paged_decode_attention_reference(*case), rtol=1e-5, atol=1e-5)


def test_cpu_kernel_reads_the_cache_in_place_from_a_layer_view():
    # The engine passes per-layer views of one big cache tensor: strided, not separately allocated.
    q, k_cache, v_cache, block_tables, seq_lens, scale = make_case(3, 4, 9, 3, 16, 60)
    big = torch.stack([torch.stack([k_cache, v_cache])] * 2)  # [layers, 2, blocks, block_size, KVH, D]
    out = paged_decode_attention_cpu(q, big[1, 0], big[1, 1], block_tables, seq_lens, scale)
    assert torch.allclose(
        out, paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale), atol=1e-5
    )


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(9, 3, 16), (32, 8, 16), (4, 4, 1)])
def test_bfloat16_cache_matches_float64_on_the_same_bfloat16_values(num_heads, num_kv_heads, block_size):
    q, k_cache, v_cache, block_tables, seq_lens, scale = make_case(5, 5, num_heads, num_kv_heads, block_size, 90)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    out = paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale)
    assert out.dtype == torch.bfloat16
    # The kernel widens bfloat16 exactly and accumulates in float32: only the output's rounding to bfloat16 differs
    # from float64 on the same values.
    expected = dense_float64_decode(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens, scale)
    assert torch.allclose(out.double(), expected, rtol=2**-7, atol=2**-7), (out.double() - expected).abs().max()
    reference = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    assert (out.float() - reference.float()).abs().max() <= 2**-6
