"""Hugging Face checkpoint directories (sharded safetensors) against transformers on the same files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from engine.core.outputs import ScheduledRequest
from engine.model.config import PRESETS, ModelConfig
from engine.model.registry import resolve_model
from engine.model.safetensors_loader import INDEX_FILE, safetensors_files
from engine.model_runner import ModelRunner

TOKENS = [5, 88, 400, 2, 17, 17, 311, 64, 9]

VARIANTS = {
    "llama-tied": PRESETS["tiny"],
    "llama-untied": replace(PRESETS["tiny"], tie_word_embeddings=False, rope_theta=500000.0),
    "qwen2-bias": replace(PRESETS["tiny"], architecture="qwen2", attention_bias=True, num_kv_heads=1),
}


def save_sharded_checkpoint(directory: Path, config: ModelConfig) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    if config.attention_bias:
        with torch.no_grad():  # biases start at zero; make them matter
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.5)
    model.save_pretrained(directory, max_shard_size="40KB")
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_checkpoint_logits_match_transformers(tmp_path: Path, variant: str):
    config = VARIANTS[variant]
    reference_model = save_sharded_checkpoint(tmp_path, config)
    assert len(safetensors_files(tmp_path)) > 1, "the checkpoint must really be sharded"

    source = resolve_model(str(tmp_path))
    assert source.kind == "safetensors"
    assert source.load_config() == config
    runner = ModelRunner(source.load_model(), num_device_blocks=8, num_host_blocks=0, block_size=4)
    ours = runner.forward([ScheduledRequest("r0", TOKENS, 0, [6, 1, 4])])
    with torch.inference_mode():
        reference = reference_model(torch.tensor([TOKENS])).logits[0]
    assert ((ours - reference).abs().amax() / reference.abs().amax()) < 1e-5


def test_missing_shard_is_a_clear_error(tmp_path: Path):
    save_sharded_checkpoint(tmp_path, PRESETS["tiny"])
    shard = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match="shards named in"):
        resolve_model(str(tmp_path)).load_model()


def test_checkpoint_missing_a_weight_is_a_clear_error(tmp_path: Path):
    from safetensors.torch import save_file

    model = save_sharded_checkpoint(tmp_path, PRESETS["tiny"])
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()
    (tmp_path / INDEX_FILE).unlink()
    state = {k: v.clone() for k, v in model.state_dict().items() if "up_proj" not in k or "layers.1." not in k}
    state.pop("lm_head.weight")  # tied to the embeddings
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"no weights for 1 parameters.*layers\.1\.mlp\.gate_up_proj"):
        resolve_model(str(tmp_path)).load_model()
