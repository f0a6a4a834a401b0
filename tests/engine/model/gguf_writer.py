"""Writes small Llama GGUF files the way llama.cpp's converter does, for loader tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from engine.model.config import ModelConfig
from engine.model.gguf_loader import permute_rotary_rows

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    top_level = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top_level:
        return top_level[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"


def write_llama_gguf(
    path: Path,
    config: ModelConfig,
    hf_state_dict: dict[str, torch.Tensor],
    matrix_type: gguf.GGMLQuantizationType,
) -> None:
    """2-D weights in ``matrix_type``, norms in F32; Q/K rows permuted as llama.cpp does."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    for hf_name, tensor in hf_state_dict.items():
        array = tensor.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            array = permute_rotary_rows(array, config.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = permute_rotary_rows(array, config.num_kv_heads)
        if array.ndim == 1 or matrix_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(hf_name), array)
        elif matrix_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(hf_name), array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(array, matrix_type), raw_dtype=matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
