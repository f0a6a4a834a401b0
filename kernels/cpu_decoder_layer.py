"""A whole Llama decoder layer in one call of the compiled CPU kernels (``kernels/csrc/decoder_layer.cpp``), for
layers whose matmuls are kvstorm's tile matmuls and whose attention is the CPU backend's: the kernels the modules
call one by one, in the same order and with the same roundings, without Python and operator dispatch between them
(about as long as the matmuls themselves in a small batch's decode step)."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, KVCacheLayer
from kernels.cpu_extension import compiled_kernels


def decoder_layer_cpu(
    layer: torch.nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: KVCacheLayer,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """``layer`` (an ``engine.model.llama.DecoderLayer`` packed for the tile matmuls) on ``x`` [T, hidden]: the
    residual stream after it; writes the step's keys and values into ``kv_cache``."""
    attn, mlp, c = layer.attn, layer.mlp, layer.attn.config
    row_seqs, row_lens = metadata.row_contexts
    return compiled_kernels().decoder_layer(
        x.contiguous(),
        layer.input_norm.weight,
        layer.post_attn_norm.weight,
        layer.input_norm.eps,
        attn.qkv_proj.packed_weight,
        attn.qkv_proj.bias,
        attn.o_proj.packed_weight,
        mlp.swiglu.gate_up,
        mlp.residual_down.down,
        cos,
        sin,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        *kv_cache,
        metadata.slot_mapping,
        metadata.block_tables,
        row_seqs,
        row_lens,
        attn.scale,
    )
