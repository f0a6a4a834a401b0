"""Greedy output must not depend on preemption: the real model, 32 requests, a KV pool far too small.

Swap must be bit-identical to a run with an ample pool. Recompute may diverge
only where the reference's top-2 logit margin is below 1e-4; each such
position is printed. The same holds for steps that run out of memory and are
retried smaller (they change how prompts are chunked, as recompute does).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.kv_cache import kv_cache_bytes_per_block
from engine.core.config import PreemptionMode
from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLM
from engine.model.packed_linear import packing_applies
from engine.model_runner import ModelRunner

TEXT = (
    "The history of computing is a story of memory. Early machines stored a few thousand words in "
    "mercury delay lines and magnetic drums; programmers counted every cell. Virtual memory freed them "
    "from that accounting by splitting memory into pages and mapping them on demand, so that a program "
    "saw one contiguous address space while its pages lived wherever the system found room. Decades "
    "later the same idea came back to serve language models: the attention cache of each conversation "
    "grows token by token, and reserving the longest possible cache for every request wastes most of it. "
    "Cutting the cache into fixed blocks lets many more conversations share one accelerator."
)
NUM_REQUESTS = 32
BLOCK_SIZE = 16
NUM_SMALL_POOL_BLOCKS = 20
MARGIN = 1e-4
# bfloat16 keeps 8 significant bits: logits of 10-20 are resolved to 0.06-0.12 (divergences seen up to 0.13).
BFLOAT16_MARGIN = 0.25


@pytest.fixture(scope="module")
def workload(real_tokenizer):
    rng = random.Random(0)
    ids = real_tokenizer.encode(TEXT)
    prompts, params = [], []
    for _ in range(NUM_REQUESTS):
        length = rng.randint(4, 90)
        start = rng.randint(0, len(ids) - length)
        prompts.append(ids[start : start + length])
        params.append(SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.0, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def real_model_bfloat16(real_source):
    """The real model in bfloat16 with the compiled CPU attention, as ``kvstorm serve`` runs it on this CPU (the
    first engine packs its weights)."""
    return real_source.load_model(dtype=torch.bfloat16, device="cpu", backend=CpuAttentionBackend())


@pytest.fixture(scope="module")
def real_model_bfloat16_onednn_latency(real_source):
    """The same, for engines whose matmuls are oneDNN's (where the CPU has AMX or AVX512-BF16 the engine takes
    its own tile matmuls otherwise) favouring latency (packed in the layout that serves a lone decode best: on a
    CPU with AMX, the "vector" layout, whose kernels agree from one row up)."""
    return real_source.load_model(dtype=torch.bfloat16, device="cpu", backend=CpuAttentionBackend())


def run(
    real_model,
    real_tokenizer,
    workload,
    num_blocks: int,
    mode: PreemptionMode,
    invariant_rows: str = "throughput",
    matmul_kernel: str = "auto",
    **faults: int,
):
    bytes_per_block = kv_cache_bytes_per_block(real_model.config, BLOCK_SIZE, next(real_model.parameters()).dtype)
    llm = LLM(
        tokenizer=real_tokenizer,
        loaded_model=real_model,
        kv_cache_memory=num_blocks * bytes_per_block,
        swap_space=64 * bytes_per_block,
        block_size=BLOCK_SIZE,
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=256,
        preemption_mode=mode,
        debug_invariants=True,
        invariant_rows=invariant_rows,
        matmul_kernel=matmul_kernel,
    )
    llm.engine.update_faults(**faults)
    prompts, params = workload
    completions = llm.generate(prompts, params)
    assert llm.engine.kv_cache_manager.device_pool.num_free_blocks == num_blocks
    assert llm.engine.kv_cache_manager.host_pool.num_free_blocks == 64
    return completions, llm.engine


def ample_pool_run(model, real_tokenizer, workload, invariant_rows="throughput", matmul_kernel="auto"):
    completions, engine = run(
        model, real_tokenizer, workload, 512, PreemptionMode.RECOMPUTE, invariant_rows, matmul_kernel
    )
    assert not engine.preemption_log
    return completions


@pytest.fixture(scope="module")
def reference(real_model, real_tokenizer, workload):
    return ample_pool_run(real_model, real_tokenizer, workload)


@pytest.fixture(scope="module")
def reference_bfloat16(real_model_bfloat16, real_tokenizer, workload):
    return ample_pool_run(real_model_bfloat16, real_tokenizer, workload)


@pytest.fixture(scope="module")
def reference_bfloat16_onednn_latency(real_model_bfloat16_onednn_latency, real_tokenizer, workload):
    return ample_pool_run(real_model_bfloat16_onednn_latency, real_tokenizer, workload, "latency", "onednn")


@pytest.mark.parametrize(
    ("model_name", "invariant_rows", "matmul_kernel"),
    [
        ("real_model", "throughput", "auto"),  # float32: oneDNN
        ("real_model_bfloat16", "throughput", "auto"),  # the tile matmuls on AMX or AVX512-BF16, else oneDNN
        pytest.param(
            "real_model_bfloat16_onednn_latency",
            "latency",
            "onednn",
            marks=pytest.mark.skipif(
                not packing_applies(torch.device("cpu"), torch.bfloat16),
                reason="oneDNN packs no bfloat16 on this CPU: unpacked, the case before runs the same matmuls",
            ),
        ),
    ],
)
def test_swap_preemption_is_bit_identical(request, real_tokenizer, workload, model_name, invariant_rows, matmul_kernel):
    # float32 with the torch reference backend; bfloat16 with the compiled one, whose every row's attention is
    # computed alone (kernels/csrc/paged_attention.cpp), so a prompt chunked differently after a preemption rounds
    # the same. With PyTorch's SDPA for prefill, bfloat16 did not. The matmuls: kvstorm's tile matmuls, invariant at
    # any row count, and oneDNN's in the row counts its probe found to agree.
    model = request.getfixturevalue(model_name)
    reference = request.getfixturevalue(model_name.replace("real_model", "reference"))
    completions, engine = run(
        model, real_tokenizer, workload, NUM_SMALL_POOL_BLOCKS, PreemptionMode.SWAP, invariant_rows, matmul_kernel
    )
    assert sum(p.mode is PreemptionMode.SWAP for p in engine.preemption_log) >= 5, "the pool must force real swapping"
    assert sum(c.num_preemptions > 0 for c in completions) >= 3
    for ours, expected in zip(completions, reference, strict=True):
        assert ours.token_ids == expected.token_ids, f"{ours.request_id} diverged after swap"


def test_recompute_preemption_diverges_only_at_near_ties(real_model, real_tokenizer, workload, reference):
    completions, engine = run(real_model, real_tokenizer, workload, NUM_SMALL_POOL_BLOCKS, PreemptionMode.RECOMPUTE)
    assert sum(p.mode is PreemptionMode.RECOMPUTE for p in engine.preemption_log) >= 5, "the pool must force recomputes"
    assert_divergence_only_at_near_ties(real_model, completions, reference)


def test_steps_that_run_out_of_memory_diverge_only_at_near_ties(real_model, real_tokenizer, workload, reference):
    # A VRAM cap of 64 tokens a step, against a budget of 256: every bigger step fails and is retried smaller.
    completions, engine = run(
        real_model, real_tokenizer, workload, 512, PreemptionMode.RECOMPUTE, oom_above_batched_tokens=64
    )
    assert engine.scheduler.back_off.num_failures >= 3
    assert all(c.finish_reason == "length" for c in completions)
    assert_divergence_only_at_near_ties(real_model, completions, reference)


def assert_divergence_only_at_near_ties(real_model, completions, reference, margin_limit: float = MARGIN) -> None:
    runner = ModelRunner(real_model, num_device_blocks=16, num_host_blocks=0, block_size=BLOCK_SIZE)
    for ours, expected in zip(completions, reference, strict=True):
        if ours.token_ids == expected.token_ids:
            continue
        position = next(i for i, (a, b) in enumerate(zip(ours.token_ids, expected.token_ids, strict=True)) if a != b)
        context = expected.prompt_token_ids + expected.token_ids[:position]
        logits = runner.forward([ScheduledRequest("r0", context, 0, list(range(16)))], positions_to_keep=[True])[0]
        top2 = logits.topk(2).values
        margin = float(top2[0] - top2[1])
        print(f"{ours.request_id}: diverged at output position {position}, top-2 margin {margin:.2e}")
        assert margin < margin_limit, f"{ours.request_id} diverged at {position} with a clear margin {margin:.2e}"


def test_bfloat16_with_the_compiled_kernel_follows_float32_but_at_near_ties(real_model, reference, reference_bfloat16):
    # bfloat16 greedy decoding may leave float32's tokens only where float32's own top-2 margin is within bfloat16's
    # resolution.
    completions = reference_bfloat16
    same = sum(ours.token_ids == expected.token_ids for ours, expected in zip(completions, reference, strict=True))
    print(f"{same} of {len(reference)} bfloat16 completions equal float32's")
    assert_divergence_only_at_near_ties(real_model, completions, reference, BFLOAT16_MARGIN)
