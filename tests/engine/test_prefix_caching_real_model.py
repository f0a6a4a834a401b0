"""Greedy output must not depend on prefix caching: the real model, 32 requests over 4 shared prefixes, in float32
and bfloat16 on the batch-invariant path (kvstorm's compiled attention computes every row alone; the matmuls are
invariant to the row count), with the cache on and off, and with a pool so small that requests are preempted by
swap and by recompute while they share blocks."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.kv_cache import kv_cache_bytes_per_block
from engine.core.config import PreemptionMode
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLM
from kernels.cpu_extension import cpu_kernels_available

TEXT = (
    "A conversation with a language model is a growing list of messages, and every turn sends the whole list again. "
    "The first part of that list is the same for every user of a service: the instructions that tell the model who "
    "it is and what it may do. Serving engines keep the attention cache of such a shared beginning and reuse it, so "
    "that each new request computes only what is new to it, and a thousand conversations pay for their common "
    "instructions once instead of a thousand times over, until memory runs short and the cache is evicted."
)
NUM_REQUESTS = 32
BLOCK_SIZE = 16
NUM_HOST_BLOCKS = 64
NUM_SMALL_POOL_BLOCKS = 24

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="kvstorm's CPU kernels did not build here")


@pytest.fixture(scope="module")
def workload(real_tokenizer):
    """Four prefixes of 50-90 tokens, each request one of them and a question of its own."""
    rng = random.Random(0)
    ids = real_tokenizer.encode(TEXT)
    prefixes = [ids[start : start + rng.randint(50, 90)] for start in (0, 11, 23, 37)]
    prompts, params = [], []
    for index in range(NUM_REQUESTS):
        length = rng.randint(2, 20)
        start = rng.randint(0, len(ids) - length)
        prompts.append(prefixes[index % 4] + ids[start : start + length])
        params.append(SamplingParams(max_tokens=rng.randint(4, 32), temperature=0.0, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model(request, real_source):
    return real_source.load_model(dtype=request.param, device="cpu", backend=CpuAttentionBackend())


def run(model, tokenizer, workload, prefix_caching: bool, num_blocks: int, mode: PreemptionMode):
    bytes_per_block = kv_cache_bytes_per_block(model.config, BLOCK_SIZE, next(model.parameters()).dtype)
    llm = LLM(
        tokenizer=tokenizer,
        loaded_model=model,
        kv_cache_memory=num_blocks * bytes_per_block,
        swap_space=NUM_HOST_BLOCKS * bytes_per_block,
        block_size=BLOCK_SIZE,
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=256,
        preemption_mode=mode,
        enable_prefix_caching=prefix_caching,
        debug_invariants=True,
    )
    completions = llm.generate(*workload)
    engine = llm.engine
    assert engine.kv_cache_manager.device_pool.num_used_blocks == 0
    assert engine.kv_cache_manager.host_pool.num_free_blocks == NUM_HOST_BLOCKS
    return [c.token_ids for c in completions], engine


def test_greedy_output_is_the_same_with_prefix_caching_on_and_off_through_swap_and_recompute(
    model, real_tokenizer, workload
):
    reference, engine = run(model, real_tokenizer, workload, False, 512, PreemptionMode.RECOMPUTE)
    assert not engine.preemption_log
    assert engine.stats().prefix_cache_queried_tokens == 0

    cached, engine = run(model, real_tokenizer, workload, True, 512, PreemptionMode.RECOMPUTE)
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= 16 * BLOCK_SIZE, "the shared prefixes must be served from the cache"
    assert cached == reference

    for mode in (PreemptionMode.SWAP, PreemptionMode.RECOMPUTE):
        tokens, engine = run(model, real_tokenizer, workload, True, NUM_SMALL_POOL_BLOCKS, mode)
        assert sum(p.mode is mode for p in engine.preemption_log) >= 5, f"the pool must force {mode.value}"
        assert engine.stats().prefix_cache_hit_tokens >= 16 * BLOCK_SIZE
        for index, (ours, expected) in enumerate(zip(tokens, reference, strict=True)):
            assert ours == expected, f"request {index} diverged with prefix caching and {mode.value}"
