"""The paged torch and cpu backends against dense causal attention in float64, on random mixed batches."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from kernels.check import dense_float64

BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}


def random_mixed_batch(generator: torch.Generator, num_seqs: int) -> list[tuple[int, int]]:
    """(context length, new tokens) per sequence: decodes, fresh prefills, and chunks with a cached prefix."""
    shapes = []
    for _ in range(num_seqs):
        seq_len = int(torch.randint(1, 70, (), generator=generator))
        kind = int(torch.randint(0, 3, (), generator=generator))
        query_len = {0: 1, 1: seq_len, 2: int(torch.randint(1, seq_len + 1, (), generator=generator))}[kind]
        shapes.append((seq_len, query_len))
    return shapes


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_mixed_batch_matches_dense_float64(num_heads, num_kv_heads, block_size, seed, backend):
    generator = torch.Generator().manual_seed(seed)
    head_dim, scale = 16, 16**-0.5
    shapes = random_mixed_batch(generator, num_seqs=7)
    num_blocks = sum(-(-s // block_size) for s, _ in shapes) + 5
    # Stale, large values everywhere: whatever the backend reads outside a sequence's context shows up.
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), 1e4)
    v_cache = torch.full_like(k_cache, -1e4)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()

    queries, new_keys, new_values, slots, block_tables, expected = [], [], [], [], [], []
    for seq_len, query_len in shapes:
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        q = torch.randn(query_len, num_heads, head_dim, generator=generator)
        blocks = [free_blocks.pop() for _ in range(-(-seq_len // block_size))]
        slot_of = [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        cached = seq_len - query_len
        k_cache.view(-1, num_kv_heads, head_dim)[slot_of[:cached]] = keys[:cached]
        v_cache.view(-1, num_kv_heads, head_dim)[slot_of[:cached]] = values[:cached]
        queries.append(q)
        new_keys.append(keys[cached:])
        new_values.append(values[cached:])
        slots.extend(slot_of[cached:])
        block_tables.append(blocks)
        expected.append(dense_float64(q, keys, values, scale))

    metadata = AttentionMetadata.build(
        [q for _, q in shapes], [s for s, _ in shapes], slots, block_tables, block_size, torch.device("cpu")
    )
    out = BACKENDS[backend]().forward(
        torch.cat(queries), torch.cat(new_keys), torch.cat(new_values), (k_cache, v_cache), metadata, scale
    )
    reference = torch.cat(expected)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5), (
        f"max error {(out.double() - reference).abs().max():.2e} for shapes {shapes}"
    )
    # The new K/V landed in their slots.
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots], torch.cat(new_keys))
