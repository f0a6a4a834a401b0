"""The engine end to end with the Triton backend (interpreted on the CPU) against the torch backend."""

from __future__ import annotations

import pytest
import torch

from engine.attention.kv_cache import kv_cache_bytes_per_block
from engine.core.config import EngineConfig, PreemptionMode
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLM, LLMEngine
from engine.model.config import PRESETS

BLOCK_SIZE = 4
BYTES_PER_BLOCK = kv_cache_bytes_per_block(PRESETS["tiny"], BLOCK_SIZE, torch.float32)


def run(backend: str) -> tuple[list[list[int]], int]:
    # 14 device blocks for 6 requests growing to 16..25 tokens (4..7 blocks each): swaps are forced.
    llm = LLM(
        "random:tiny",
        device="cpu",
        dtype="float32",  # BYTES_PER_BLOCK's
        attention_backend=backend,
        block_size=BLOCK_SIZE,
        kv_cache_memory=14 * BYTES_PER_BLOCK,
        swap_space=32 * BYTES_PER_BLOCK,
        watermark=0.0,
        max_num_batched_tokens=12,
        max_num_seqs=6,
        preemption_mode=PreemptionMode.SWAP,
        debug_invariants=True,
    )
    prompts = [[(7 * i + j) % 500 + 1 for j in range(length)] for i, length in enumerate([9, 3, 14, 6, 1, 11])]
    completions = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return [c.token_ids for c in completions], sum(c.num_preemptions for c in completions)


def test_triton_backend_generates_the_torch_backends_greedy_tokens_through_swaps():
    triton_tokens, triton_preemptions = run("triton")
    torch_tokens, torch_preemptions = run("torch")
    assert triton_preemptions > 0
    assert torch_preemptions > 0
    assert triton_tokens == torch_tokens


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    config = EngineConfig(model="random:tiny", device="cpu", attention_backend="triton")
    with pytest.raises(ValueError, match="needs CUDA"):
        LLMEngine.from_config(config)
