"""Our Llama against transformers' on the real SmolLM2 weights: logits at every position, greedy tokens."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLM
from engine.model_runner import ModelRunner

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paged attention stores the KV cache in fixed-size blocks so that memory is not reserved "
    "for the longest possible sequence. Each request owns a block table.",
    "Hi",
    "¿Dónde está la biblioteca? 東京は日本の首都です。 🚀",
]
BLOCK_SIZE = 16


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per position: largest absolute difference over the largest reference logit magnitude."""
    return (ours - reference).abs().amax(dim=-1) / reference.abs().amax(dim=-1)


@torch.inference_mode()
def hf_logits(hf_oracle, token_ids: list[int]) -> torch.Tensor:
    return hf_oracle(torch.tensor([token_ids])).logits[0]


def make_runner(model, num_blocks: int = 64) -> ModelRunner:
    return ModelRunner(model, num_device_blocks=num_blocks, num_host_blocks=0, block_size=BLOCK_SIZE)


def make_llm(model, tokenizer) -> LLM:
    return LLM(tokenizer=tokenizer, loaded_model=model, kv_cache_memory=64 << 20, swap_space=0)


def test_logits_match_transformers_at_every_position_in_one_mixed_batch(real_model, real_tokenizer, hf_oracle):
    prompts = [real_tokenizer.encode(p) for p in PROMPTS]
    # All prompts in one step, each in its own non-contiguous blocks, as the engine will batch them.
    block_tables, next_block = [], 0
    for ids in prompts:
        num_blocks = -(-len(ids) // BLOCK_SIZE)
        block_tables.append(list(range(next_block + num_blocks - 1, next_block - 1, -1)))
        next_block += num_blocks + 1
    runner = make_runner(real_model, num_blocks=next_block)
    chunks = [ScheduledRequest("r0", ids, 0, blocks) for ids, blocks in zip(prompts, block_tables, strict=True)]
    ours = runner.forward(chunks).split([len(ids) for ids in prompts])
    for ids, logits in zip(prompts, ours, strict=True):
        error = relative_error(logits, hf_logits(hf_oracle, ids))
        assert error.max() < 1e-4, f"prompt of {len(ids)} tokens: max relative error {error.max():.2e}"


def test_chunked_prefill_through_the_cache_matches_transformers(real_model, real_tokenizer, hf_oracle):
    ids = real_tokenizer.encode(PROMPTS[2])
    runner = make_runner(real_model)
    blocks = list(range(10))
    # Chunks of 7, 13 and the rest: each attends to the K/V the previous ones left in the paged cache.
    cuts = [0, 7, 20, len(ids)]
    logits = torch.cat(
        [runner.forward([ScheduledRequest("r0", ids[a:b], a, blocks)]) for a, b in itertools.pairwise(cuts)]
    )
    error = relative_error(logits, hf_logits(hf_oracle, ids))
    assert error.max() < 1e-4, f"max relative error {error.max():.2e}"


def test_greedy_chat_answer_matches_transformers_generate(real_model, real_tokenizer, hf_oracle):
    prompt_ids = real_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=32, temperature=0.0)
    ours = make_llm(real_model, real_tokenizer).generate([prompt_ids], params)[0].token_ids
    with torch.inference_mode():
        reference = hf_oracle.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=32,
            do_sample=False,
        )[0, len(prompt_ids) :].tolist()
    assert ours == reference
    assert "Paris" in real_tokenizer.decode(ours)


@pytest.mark.parametrize("seed", [0, 1234])
def test_seeded_sampling_is_reproducible(real_model, real_tokenizer, seed):
    prompt_ids = real_tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=seed)
    llm = make_llm(real_model, real_tokenizer)
    first, second = llm.generate([prompt_ids, prompt_ids], params)
    assert first.token_ids == second.token_ids
    assert first.token_ids == llm.generate([prompt_ids], params)[0].token_ids
