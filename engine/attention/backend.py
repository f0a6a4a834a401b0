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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.kv_cache_manager import num_blocks_for


@dataclass
class AttentionMetadata:
    """Per-step batch layout, built once by the model runner and shared by every layer.

    Sequences with a single new token (decodes) can also be described as their own
    batch (``decode_batch``), so a backend can attend for all of them at once; the
    others (prefill chunks) are listed by index. Each backend builds only the views it
    reads, on first use.
    """

    slot_mapping: torch.Tensor  # [T] int64, on the model's device
    block_tables: torch.Tensor  # [B, max_blocks] int64, zero-padded
    query_start_loc_cpu: list[int]  # [B + 1]
    seq_lens_cpu: list[int]  # [B]
    prefill_indices: list[int]  # sequences with more than one new token
    block_size: int

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        query_start_loc = [0]
        for query_len in query_lens:
            query_start_loc.append(query_start_loc[-1] + query_len)
        max_blocks = max(len(t) for t in block_tables)
        return cls(
            slot_mapping=int64_tensor(slot_mapping, device),
            block_tables=int64_tensor([_padded(t, max_blocks) for t in block_tables], device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            prefill_indices=[i for i, query_len in enumerate(query_lens) if query_len != 1],
            block_size=block_size,
        )

    @functools.cached_property
    def decode_batch(self) -> DecodeBatch:
        """The single-token decodes as their own batch, for backends that attend them in one launch.

        Built on first use (by the first layer) and shared by the others.
        """
        device = self.slot_mapping.device
        starts, seq_lens = self.query_start_loc_cpu, self.seq_lens_cpu
        decodes = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        max_decode_blocks = max((num_blocks_for(seq_lens[i], self.block_size) for i in decodes), default=0)
        return DecodeBatch(
            token_rows=int64_tensor([starts[i] for i in decodes], device),
            seq_lens=int64_tensor([seq_lens[i] for i in decodes], device),
            block_tables=self.block_tables[int64_tensor(decodes, device), :max_decode_blocks],
        )

    @functools.cached_property
    def row_contexts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For every row of the step: its sequence, and how many tokens of that sequence's context it attends to
        (its own position + 1), as int64 tensors [T], for backends that attend every row alike.

        Built on first use (by the first layer) and shared by the others.
        """
        device = self.slot_mapping.device
        starts = torch.tensor(self.query_start_loc_cpu, dtype=torch.int64)
        row_seqs = torch.repeat_interleave(torch.arange(len(self.seq_lens_cpu)), starts[1:] - starts[:-1])
        # A sequence's last row sees its whole context; each row before it one token less.
        rows_after = starts[1:][row_seqs] - 1 - torch.arange(len(row_seqs))
        row_lens = torch.tensor(self.seq_lens_cpu, dtype=torch.int64)[row_seqs] - rows_after
        return row_seqs.to(device), row_lens.to(device)

    @functools.cached_property
    def prefill_batch(self) -> PrefillBatch:
        """The prefill chunks as their own packed batch, for backends that attend them in one launch.

        Built on first use (by the first layer) and shared by the others.
        """
        device = self.slot_mapping.device
        starts, seq_lens = self.query_start_loc_cpu, self.seq_lens_cpu
        query_lens = [starts[i + 1] - starts[i] for i in self.prefill_indices]
        token_rows = [row for i in self.prefill_indices for row in range(starts[i], starts[i + 1])]
        query_start_loc = [0]
        for query_len in query_lens:
            query_start_loc.append(query_start_loc[-1] + query_len)
        return PrefillBatch(
            token_rows=int64_tensor(token_rows, device),
            query_start_loc=int64_tensor(query_start_loc, device),
            seq_lens=int64_tensor([seq_lens[i] for i in self.prefill_indices], device),
            block_tables=self.block_tables[int64_tensor(self.prefill_indices, device)],
            max_query_len=max(query_lens, default=0),
        )


@dataclass
class DecodeBatch:
    token_rows: torch.Tensor  # [D] row of each decode's token in the step's T
    seq_lens: torch.Tensor  # [D]
    block_tables: torch.Tensor  # [D, max_decode_blocks]


@dataclass
class PrefillBatch:
    token_rows: torch.Tensor  # [P] rows of the step's T that belong to prefill chunks, in order
    query_start_loc: torch.Tensor  # [S + 1] into those rows
    seq_lens: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [S, max_blocks]
    max_query_len: int


def int64_tensor(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _padded(block_ids: list[int], length: int) -> list[int]:
    return block_ids + [0] * (length - len(block_ids))


KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, block_size, num_kv_heads, head_dim]
# (q [B, H, D], k_cache, v_cache, block_tables [B, max_blocks], seq_lens [B], scale) -> [B, H, D]
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def attend_decodes(
    decode_kernel: DecodeKernel,
    q: torch.Tensor,
    kv_cache: KVCacheLayer,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Every single-token decode of the step in one kernel call, into its rows of ``out``."""
    decodes = metadata.decode_batch
    if decodes.token_rows.numel():
        out[decodes.token_rows] = decode_kernel(
            q[decodes.token_rows], kv_cache[0], kv_cache[1], decodes.block_tables, decodes.seq_lens, scale
        )


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache, then attends; also moves blocks between caches.

    ``forward``: ``q`` [T, num_heads, head_dim]; ``k``, ``v``: [T, num_kv_heads, head_dim].
    Returns [T, num_heads, head_dim] in ``q``'s dtype. Each query attends
    causally to its own sequence's context only.

    ``copy_blocks(src, dst, block_mapping)``: whole caches ``[layers, 2, blocks, ...]``, rows ``(a, b)`` of the
    int64 CPU tensor ``block_mapping`` copy block ``a`` of ``src`` to block ``b`` of ``dst``.
    """

    name: str  # the --attention-backend that names it: torch, cpu or triton
    # Whether the compiled decoder-layer kernel computes this backend's attention bit for bit, so a layer may run as
    # one call (engine.model.decoder_layer_kernel).
    fuses_into_decoder_layer: bool

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
