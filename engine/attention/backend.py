"""The contract between the model and whatever computes attention over the paged KV cache.

A step's tokens are laid out back to back (no padding): sequence ``i`` owns the
query rows ``query_start_loc[i] : query_start_loc[i + 1]``. Its context is
``seq_lens[i]`` tokens long, the new ones being the last of them::

    seq i context:  [ cached prefix ............ | new tokens ]
                    0                 seq_len - query_len     seq_len

K/V of token ``t`` is written to flat slot ``slot_mapping[t]`` (block id *
block_size + offset); ``block_tables[i]`` lists the blocks of sequence ``i`` in
order (padded with zeros past its last block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch layout, built once by the model runner and shared by every layer."""

    query_start_loc: torch.Tensor  # [B + 1] int64, on the model's device
    seq_lens: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))


KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, block_size, num_kv_heads, head_dim]


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache, then attends.

    ``q``: [T, num_heads, head_dim]; ``k``, ``v``: [T, num_kv_heads, head_dim].
    Returns [T, num_heads, head_dim] in ``q``'s dtype. Each query attends
    causally to its own sequence's context only.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
