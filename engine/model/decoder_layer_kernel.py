"""The CPU fast path of a decoder layer: the whole layer in one call of the compiled CPU kernels
(``kernels/csrc/decoder_layer.cpp``).

The kernel runs what the layer's modules run one by one, in the same order and with the same roundings, without
Python and operator dispatch between them (about as long as the matmuls themselves in a small batch's decode step).
It applies where every matmul of the layer is packed for kvstorm's tile matmuls and the attention backend says the
kernel computes its attention bit for bit (``AttentionBackend.fuses_into_decoder_layer``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCacheLayer
from engine.model.packed_linear import TILE_LAYOUT
from kernels.cpu_extension import compiled_kernels


def runs_in_one_call(layer: nn.Module, backend: AttentionBackend) -> bool:
    """Whether ``forward_in_one_call`` computes ``layer`` (a ``engine.model.llama.DecoderLayer``)."""
    matmuls = (
        layer.attn.qkv_proj,
        layer.attn.o_proj,
        getattr(layer.mlp, "swiglu", None),
        getattr(layer.mlp, "residual_down", None),
    )
    return backend.fuses_into_decoder_layer and all(getattr(m, "layout", None) == TILE_LAYOUT for m in matmuls)


def forward_in_one_call(
    layer: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: KVCacheLayer,
    metadata: AttentionMetadata,
) -> torch.Tensor:
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
