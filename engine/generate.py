"""Single-request streaming generation: prefill the prompt, then decode token by token."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.model_runner import ModelRunner, ScheduledChunk
from engine.sampling import SamplingParams, make_generator, sample


def generate_token_ids(
    runner: ModelRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int] = frozenset(),
) -> Iterator[int]:
    """Yield generated token ids until ``max_tokens``, an EOS (unless ``ignore_eos``) or a stop token.

    The request owns blocks 0, 1, 2, ... of the runner's cache, in order.
    """
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    total = len(prompt_ids) + params.max_tokens
    max_len = min(runner.num_blocks * runner.block_size, runner.model.config.max_position_embeddings)
    if total > max_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds {max_len}")
    block_ids = list(range(-(-total // runner.block_size)))
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    generator = make_generator(params, runner.device)
    chunk = ScheduledChunk(list(prompt_ids), 0, block_ids)
    for step in range(params.max_tokens):
        token_id = sample(runner.execute([chunk]), [params], [generator])[0]
        yield token_id
        if token_id in stop_ids:
            return
        chunk = ScheduledChunk([token_id], len(prompt_ids) + step, block_ids)
