"""Triton kernels over the paged KV cache: cache writes, decode attention (split-K) and varlen prefill attention.

Each has the signature of its reference in ``kernels.reference``. They run on CUDA, and on the CPU under
``TRITON_INTERPRET=1`` (set before this module is imported), which is how the tests check them.

K/V of a context are read straight from their blocks: a tile of ``BLOCK_N`` token positions looks up each
position's block id in the block table, so tiles need not align with cache blocks. Scores and the softmax
are accumulated in float32 (online softmax), whatever the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Decode contexts are split into partitions of this many tokens, attended in parallel and merged, so a small
# batch of long sequences still spreads over the whole GPU.
DECODE_PARTITION_SIZE = 512
# Tiles and warps that compile without a register spill for sm_80 and sm_90 at every configuration the engine
# launches (``kvstorm bench kernels-aot``): 64-token tiles with 4 warps spilled up to 7 KB per thread in decode
# and 100 KB in float32 prefill, and a 32x32 prefill tile with 8 warps still 16-24 bytes at head_dim 64 (ptxas
# then aims at 128 registers). Decode: (BLOCK_N, num_warps) by cache dtype; float32's IEEE dot needs smaller
# tiles.
DECODE_TILES = {torch.float32: (16, 4)}
DECODE_TILES_16BIT = (32, 8)
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 16
PREFILL_NUM_WARPS = 8


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # float32 inputs would otherwise be rounded to TF32 on NVIDIA GPUs.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_tile(
    q,
    acc,
    running_max,
    running_sum,
    positions,
    key_valid,
    visible,
    k_cache_ptr,
    v_cache_ptr,
    table,
    kv_head,
    scale,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One online-softmax step: the rows of ``q`` against the keys at ``positions`` of one sequence (read through
    its block ``table``), where ``visible``; returns the updated accumulator, running max and running sum."""
    block_ids = tl.load(table + positions // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    rows = (
        block_ids[:, None] * stride_cache_block
        + (positions % BLOCK_SIZE)[:, None] * stride_cache_token
        + kv_head * stride_cache_head
        + tl.arange(0, HEAD_DIM)[None, :]
    )
    k = tl.load(k_cache_ptr + rows, mask=key_valid[:, None], other=0.0)
    scores = tl.where(visible, _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    correction = tl.exp(running_max - new_max)
    probs = tl.exp(scores - new_max[:, None])
    running_sum = running_sum * correction + tl.sum(probs, axis=1)
    v = tl.load(v_cache_ptr + rows, mask=key_valid[:, None], other=0.0)
    acc = acc * correction[:, None] + _dot(probs.to(v.dtype), v, IEEE)
    return acc, new_max, running_sum


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < NUM_KV_HEADS
    cache_offset = (
        (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_token + heads * stride_cache_head
    )
    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offset + dims, key, mask=mask)
    tl.store(v_cache_ptr + cache_offset + dims, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``reshape_and_cache_reference``: one program per token, all its KV heads."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_cache_pair(k_cache, v_cache)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
    )


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale,
    stride_q_seq,
    stride_q_head,
    stride_out_seq,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    num_heads,
    num_partitions,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program: one sequence, one KV head with all the query heads that share it, one partition of the context.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = partition * PARTITION_SIZE
    if start >= seq_len:
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    head_mask = group < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=head_mask[:, None])

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < end
        acc, running_max, running_sum = _attend_tile(
            q, acc, running_max, running_sum, positions, valid, valid[None, :], k_cache_ptr, v_cache_ptr, table,
            kv_head, scale, stride_cache_block, stride_cache_token, stride_cache_head, HEAD_DIM, BLOCK_SIZE, IEEE,
        )  # fmt: skip

    if SINGLE_PARTITION:
        out = acc / running_sum[:, None]
        out_rows = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        # Partials are [num_seqs, num_heads, num_partitions] (+ [HEAD_DIM] for the accumulator), contiguous.
        partial = (seq * num_heads + heads) * num_partitions + partition
        tl.store(partial_max_ptr + partial, running_max, mask=head_mask)
        tl.store(partial_sum_ptr + partial, running_sum, mask=head_mask)
        tl.store(partial_acc_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_mask[:, None])


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    seq_lens_ptr,
    stride_out_seq,
    stride_out_head,
    num_heads,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
):
    # Merges one (sequence, head)'s partitions: rescale each partial by exp(its max - global max).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, PARTITION_SIZE)
    parts = tl.arange(0, PARTITIONS_PAD)
    valid = parts < used
    base = (seq * num_heads + head) * num_partitions
    maxima = tl.load(partial_max_ptr + base + parts, mask=valid, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + base + parts, mask=valid, other=0.0)
    weights = tl.where(valid, tl.exp(maxima - tl.max(maxima, axis=0)), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(partial_acc_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty))


def decode_tiles(cache_dtype: torch.dtype) -> tuple[int, int]:
    """The decode kernel's (BLOCK_N, num_warps) for a cache dtype."""
    return DECODE_TILES.get(cache_dtype, DECODE_TILES_16BIT)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    partition_size: int = DECODE_PARTITION_SIZE,
    block_n: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_decode_attention_reference`` (into ``out`` when given).

    The number of partitions comes from the block table's width (the longest context, rounded up to a block),
    so the launch needs no device-to-host read of ``seq_lens``.
    """
    num_seqs, num_heads, head_dim = q.shape
    _check_cache_pair(k_cache, v_cache)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    default_block_n, default_warps = decode_tiles(k_cache.dtype)
    block_n, num_warps = block_n or default_block_n, num_warps or default_warps
    if partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} must be a multiple of block_n {block_n}")
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    num_partitions = triton.cdiv(block_tables.shape[1] * block_size, partition_size)
    single = num_partitions == 1
    partial_shape = (num_seqs, num_heads, 0 if single else num_partitions)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty_like(partial_max)
    partial_acc = torch.empty((*partial_shape, head_dim), dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out,
        partial_acc,
        partial_max,
        partial_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        num_partitions,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs at least 16 rows
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        SINGLE_PARTITION=single,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
    )
    if not single:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            partial_acc,
            partial_max,
            partial_sum,
            seq_lens,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_partitions,
            HEAD_DIM=head_dim,
            PARTITION_SIZE=partition_size,
            PARTITIONS_PAD=triton.next_power_of_2(num_partitions),
        )
    return out


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program: BLOCK_M query rows of one sequence, one query head.
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < query_len
    query_pos = seq_len - query_len + rows  # absolute positions: each row sees keys 0..query_pos
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (query_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_rows, mask=row_valid[:, None], other=0.0)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    # The last key any row of this tile sees; every row sees key 0, so no row is fully masked in the first tile.
    key_end = tl.minimum(seq_len, seq_len - query_len + (tile + 1) * BLOCK_M)
    for tile_start in range(0, key_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        key_valid = positions < key_end
        visible = key_valid[None, :] & (positions[None, :] <= query_pos[:, None])
        acc, running_max, running_sum = _attend_tile(
            q, acc, running_max, running_sum, positions, key_valid, visible, k_cache_ptr, v_cache_ptr, table,
            kv_head, scale, stride_cache_block, stride_cache_token, stride_cache_head, HEAD_DIM, BLOCK_SIZE, IEEE,
        )  # fmt: skip

    out = acc / running_sum[:, None]
    out_rows = (query_start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int = PREFILL_BLOCK_M,
    block_n: int = PREFILL_BLOCK_N,
    num_warps: int = PREFILL_NUM_WARPS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_prefill_attention_reference`` (``query_start_loc`` and ``seq_lens`` on q's device),
    into ``out`` when given."""
    num_tokens, num_heads, head_dim = q.shape
    _check_cache_pair(k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_prefill_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
    )
    return out


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The kernels address K and V with one set of strides and assume a contiguous, power-of-two head_dim.
    head_dim = k_cache.shape[-1]
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim, got {head_dim}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            f"K and V caches must share shape and strides with a contiguous last dimension; got "
            f"{tuple(k_cache.shape)}/{k_cache.stride()} and {tuple(v_cache.shape)}/{v_cache.stride()}"
        )
