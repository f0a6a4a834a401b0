"""Turns scheduled chunks into tensors, runs the model over the paged KV cache, returns logits.

This is the only engine module that touches device tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.kv_cache import allocate_kv_cache
from engine.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence for this step.

    ``num_computed_tokens`` tokens of the sequence are already in the cache; the
    new ones take positions after them. ``block_ids`` is the sequence's block
    table and must already cover ``num_computed_tokens + len(token_ids)`` slots.
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]


class ModelRunner:
    """Owns the model and the device KV cache; executes one step at a time."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        parameter = next(model.parameters())
        self.device = parameter.device
        self.kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, parameter.dtype, self.device)

    def slot_of(self, block_ids: Sequence[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk], all_positions: bool = False) -> torch.Tensor:
        """Logits [num_chunks, vocab] of each chunk's last token, or [total_tokens, vocab] with ``all_positions``."""
        input_ids, positions, metadata = self.prepare_inputs(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        if not all_positions:
            hidden = hidden[metadata.query_start_loc[1:] - 1]
        return self.model.compute_logits(hidden)

    def prepare_inputs(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for chunk in chunks:
            start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + len(chunk.token_ids)
            if len(chunk.block_ids) * self.block_size < end:
                raise ValueError(f"block table of {len(chunk.block_ids)} blocks cannot hold {end} tokens")
            token_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            slots.extend(self.slot_of(chunk.block_ids, position) for position in range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
        max_blocks = max(len(c.block_ids) for c in chunks)
        block_tables = [list(c.block_ids) + [0] * (max_blocks - len(c.block_ids)) for c in chunks]
        query_start_loc = [0]
        for query_len in query_lens:
            query_start_loc.append(query_start_loc[-1] + query_len)

        def on_device(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        metadata = AttentionMetadata(
            query_start_loc=on_device(query_start_loc),
            seq_lens=on_device(seq_lens),
            slot_mapping=on_device(slots),
            block_tables=on_device(block_tables),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return on_device(token_ids), on_device(positions), metadata
