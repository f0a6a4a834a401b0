"""Hugging Face weight names to kvstorm's parameters: ``model.layers.3.self_attn.q_proj.weight`` is the ``q`` shard
of ``layers.3.attn.qkv_proj.weight``, and so on. The model fuses QKV and gate+up; a checkpoint keeps them apart."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.model.config import ModelConfig

# model.layers.3.self_attn.q_proj.weight -> ("3", "self_attn", "q_proj", "weight")
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.(weight|bias)")
_HF_NORM_NAME = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight")
_RENAMED = {"self_attn": "attn", "input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm"}
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_HF_TOP_LEVEL = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight"}


@torch.no_grad()
def load_hf_weights(model: nn.Module, config: ModelConfig, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into ``model``'s (fused) parameters.

    Raises ``ValueError`` on an unknown name, a shape mismatch, or a parameter left unset.
    """
    params = dict(model.named_parameters())
    expected = {(name, shard) for name in params for shard in _shards_of(name)}
    loaded: set[tuple[str, str | None]] = set()
    for hf_name, tensor in named_tensors:
        target = parameter_for(hf_name, config)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise ValueError(f"weight {hf_name!r} maps to unknown parameter {name!r}")
        dest = params[name].data
        if shard is not None:
            dest = dest.narrow(0, *_shard_range(shard, config))
        if dest.shape != tensor.shape:
            raise ValueError(f"weight {hf_name!r}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
        dest.copy_(tensor)
        loaded.add((name, shard))
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint has no weights for {len(missing)} parameters, e.g. {sorted(missing)[:4]}")


def parameter_for(hf_name: str, config: ModelConfig) -> tuple[str, str | None] | None:
    """Our parameter name (and fused shard) for a Hugging Face weight name; None to skip it."""
    if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
        return None
    if hf_name == "lm_head.weight":
        return "lm_head.weight", None
    match = _HF_LAYER_NAME.fullmatch(hf_name)
    if match:
        layer, module, proj, kind = match.groups()
        if proj in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[proj]
            return f"layers.{layer}.{_RENAMED.get(module, module)}.{fused}.{kind}", shard
        return f"layers.{layer}.{_RENAMED.get(module, module)}.{proj}.{kind}", None
    match = _HF_NORM_NAME.fullmatch(hf_name)
    if match:
        layer, norm = match.groups()
        return f"layers.{layer}.{_RENAMED[norm]}.weight", None
    renamed = _HF_TOP_LEVEL.get(hf_name)
    if renamed is None:
        raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
    return renamed, None


def _shard_range(shard: str, c: ModelConfig) -> tuple[int, int]:
    return {
        "q": (0, c.q_size),
        "k": (c.q_size, c.kv_size),
        "v": (c.q_size + c.kv_size, c.kv_size),
        "gate": (0, c.intermediate_size),
        "up": (c.intermediate_size, c.intermediate_size),
    }[shard]


def _shards_of(param_name: str) -> tuple[str | None, ...]:
    if ".qkv_proj." in param_name:
        return ("q", "k", "v")
    if ".gate_up_proj." in param_name:
        return ("gate", "up")
    return (None,)
