"""Workload w1-throughput and the FLOPs it needs: 128 requests of random token ids (100..49000, below the
vocabulary), prompt lengths uniform in [64, 512], output lengths uniform in [32, 256], greedy, ignore_eos (every
request produces exactly its output length), all submitted at once, seed 0."""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.model.config import ModelConfig


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def w1_throughput(num_requests: int = 128, vocab_size: int = 49152, seed: int = 0) -> Workload:
    """Token ids are drawn below ``vocab_size`` too, so small test models can run the workload."""
    rng = random.Random(seed)
    max_token_id = min(49000, vocab_size - 1)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompts.append([rng.randint(100, max_token_id) for _ in range(rng.randint(64, 512))])
        output_lens.append(rng.randint(32, 256))
    return Workload(prompts, output_lens)


@dataclass(frozen=True)
class WorkloadFlops:
    """``nominal``: 2 x parameters for every prompt and output token, plus attention (the usual yardstick).
    ``required``: what must really be computed: every token that is fed through the model, the LM head
    only where a token is sampled, plus attention."""

    nominal: float
    required: float
    attention: float


def count_flops(config: ModelConfig, workload: Workload) -> WorkloadFlops:
    embedding = config.vocab_size * config.hidden_size
    body = config.num_parameters() - embedding - (0 if config.tie_word_embeddings else embedding)
    attention = 0.0
    fed_tokens = 0
    for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True):
        fed = len(prompt) + output_len - 1  # the last sampled token is never fed back
        fed_tokens += fed
        # Token at position t attends to t + 1 keys: QK^T and PV are 2 * q_size MACs per key per layer.
        attention += 4 * config.q_size * config.num_layers * fed * (fed + 1) / 2
    total_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    nominal = 2 * config.num_parameters() * total_tokens + attention
    required = 2 * body * fed_tokens + 2 * embedding * workload.num_output_tokens + attention
    return WorkloadFlops(nominal=nominal, required=required, attention=attention)
