"""Read a Llama-family GGUF file: its architecture and its weights under Hugging Face names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.model.config import ModelConfig

SUPPORTED_TENSOR_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q8_0,
    }
)
# GGUF architectures we read, and the Hugging Face model type each corresponds to.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_gguf_config(reader: gguf.GGUFReader) -> ModelConfig:
    """Architecture from the GGUF metadata; raises ``ValueError`` for architectures we cannot run."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab_size = _field(reader, f"{arch}.vocab_size", default=None)
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", default=num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", default=hidden // num_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", default=10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", default=1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", default=2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        architecture=GGUF_ARCHITECTURES[arch],
    )


def iter_gguf_weights(
    reader: gguf.GGUFReader, config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize tensor by tensor (peak memory: one tensor in float32) under Hugging Face names."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"tensor {tensor.name!r} has type {tensor.tensor_type.name}; supported: "
                f"{sorted(t.name for t in SUPPORTED_TENSOR_TYPES)}"
            )
        hf_name, layer_kind = _hf_name(tensor.name)
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if not weights.flags.writeable:  # an F32 tensor comes back as a view of the read-only memory map
            weights = weights.copy()
        weights = weights.reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if config.architecture == "llama" and layer_kind in ("attn_q", "attn_k"):
            num_heads = config.num_heads if layer_kind == "attn_q" else config.num_kv_heads
            weights = unpermute_rotary_rows(weights, num_heads)
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weights)).to(dtype)


def unpermute_rotary_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half halves).

    The converter maps, per head, rows [x0 .. x(d/2-1), y0 .. y(d/2-1)] to
    [x0, y0, x1, y1, ...]; this is the inverse.
    """
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )


def permute_rotary_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's conversion from Hugging Face Q/K rows to GGUF order (used to write test files)."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )


def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return gguf.GGUFReader(path)


def _hf_name(gguf_name: str) -> tuple[str, str | None]:
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name], None
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_TENSORS[kind]}.{suffix}", kind


_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, default: object = _MISSING) -> object:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()
