"""The compiled CPU paged attention kernel against the torch reference and a float64 dense computation: decode rows
(one per sequence, its whole context), prefill rows (causal), and the same query giving the same bits whatever
rows it runs with."""

from __future__ import annotations

import pytest
import torch

from kernels.check import dense_float64
from kernels.cpu_paged_attention import paged_attention_cpu
from kernels.reference import paged_decode_attention_reference


def paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """The kernel with one decode row per sequence (the decode reference's signature)."""
    return paged_attention_cpu(q, k_cache, v_cache, block_tables, torch.arange(len(q)), seq_lens, scale)


def make_case(
    seed: int, num_seqs: int, num_heads: int, num_kv_heads: int, block_size: int, max_len: int, head_dim: int = 64
):
    generator = torch.Generator().manual_seed(seed)
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


# Head sizes 32, 64 and 128 with groups of up to 8 query heads per KV head take the AVX-512 path where the build
# has it; 48, and the group of 16, take the portable loop on every machine.
HEAD_SHAPES = [(4, 4, 64), (9, 3, 64), (8, 2, 64), (32, 8, 64), (8, 1, 128), (6, 2, 32), (9, 3, 48), (16, 1, 64)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_kernel_matches_reference_and_float64(num_heads, num_kv_heads, head_dim, block_size, seed):
    case = make_case(seed, 5, num_heads, num_kv_heads, block_size, max_len=90, head_dim=head_dim)
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


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_bfloat16_cache_matches_float64_on_the_same_bfloat16_values(num_heads, num_kv_heads, head_dim, block_size):
    q, k_cache, v_cache, block_tables, seq_lens, scale = make_case(
        5, 5, num_heads, num_kv_heads, block_size, 90, head_dim
    )
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    out = paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale)
    assert out.dtype == torch.bfloat16
    # The kernel widens bfloat16 exactly and accumulates in float32: only the output's rounding to bfloat16 differs
    # from float64 on the same values.
    expected = dense_float64_decode(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens, scale)
    assert torch.allclose(out.double(), expected, rtol=2**-7, atol=2**-7), (out.double() - expected).abs().max()
    reference = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    assert (out.float() - reference.float()).abs().max() <= 2**-6


@pytest.mark.parametrize("head_dim", [64, 48])
def test_long_contexts_with_sharp_scores_match_float64(head_dim):
    # Contexts of many blocks (the kernel prefetches blocks ahead) and scores spread over tens of units, so the
    # exponentials span float32's range down to underflow.
    q, k_cache, v_cache, block_tables, seq_lens, scale = make_case(7, 3, 9, 3, 16, 1000, head_dim)
    q = q * 30  # scores with a spread of about 200
    out = paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale)
    expected = dense_float64_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
    # float32 sums over 1000 positions in order: a few float32 epsilons per position at most, wherever the kernel
    # runs (the portable loops of a CPU without AVX-512 came within 1.5e-5); a lost or doubled block is off by ~1e-1.
    assert torch.allclose(out.double(), expected, rtol=5e-5, atol=5e-5), (out.double() - expected).abs().max()


def whole_prompts(seq_lens):
    """Every position of every sequence as a row, the sequences one after another (as a step gives prompts)."""
    row_seqs = torch.cat([torch.full((int(n),), i) for i, n in enumerate(seq_lens)])
    row_lens = torch.cat([torch.arange(1, int(n) + 1) for n in seq_lens])
    return row_seqs, row_lens


# (query dtype, cache dtype): a bfloat16 model, a float32 one, and float32 queries over a bfloat16 cache.
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEAD_SHAPES)
def test_prefill_rows_attend_causally_and_match_the_same_query_as_a_decode(
    q_dtype, cache_dtype, num_heads, num_kv_heads, head_dim
):
    # Sequences of 1 to 200 tokens in blocks of 16, every head shape and dtype mix: each row gives the same bits with
    # its prompt in order (as a step gives it), with every row of the call shuffled, and alone as a decode.
    _, k_cache, v_cache, block_tables, seq_lens, scale = make_case(11, 4, num_heads, num_kv_heads, 16, 200, head_dim)
    seq_lens[0] = 1
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    row_seqs, row_lens = whole_prompts(seq_lens)
    queries = torch.randn(len(row_seqs), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(q_dtype)
    out = paged_attention_cpu(queries, k_cache, v_cache, block_tables, row_seqs, row_lens, scale)
    order = torch.randperm(len(row_seqs), generator=torch.Generator().manual_seed(0))
    shuffled = paged_attention_cpu(
        queries[order], k_cache, v_cache, block_tables, row_seqs[order], row_lens[order], scale
    )
    assert torch.equal(shuffled, out[order])
    for row in range(0, len(row_seqs), 37):
        seq, length = int(row_seqs[row]), int(row_lens[row])
        keys, values = (c[block_tables[seq]].flatten(0, 1)[:length] for c in (k_cache, v_cache))
        expected = dense_float64(queries[row : row + 1].double(), keys.double(), values.double(), scale)
        tolerance = 1e-5 if q_dtype == torch.float32 else 2**-7
        assert torch.allclose(out[row : row + 1].double(), expected, rtol=tolerance, atol=tolerance)
        # The same query at the same position alone, as a decode of a context that ends there: the same bits.
        alone = paged_attention_cpu(
            queries[row : row + 1], k_cache, v_cache, block_tables, row_seqs[row : row + 1], row_lens[row : row + 1],
            scale,
        )  # fmt: skip
        assert torch.equal(alone, out[row : row + 1])
