"""GGUF loading for every tensor type we read, checked against the original weights and transformers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.core.outputs import ScheduledRequest
from engine.model.config import PRESETS, ModelConfig
from engine.model.gguf_loader import open_gguf, permute_rotary_rows, read_gguf_config, unpermute_rotary_rows
from engine.model.registry import resolve_model
from engine.model_runner import ModelRunner
from tests.engine.model.gguf_writer import write_llama_gguf

Q = gguf.GGMLQuantizationType
# Largest error of one dequantized weight, relative to the largest magnitude in its 32-value block.
RELATIVE_ROUNDING = {Q.F32: 0.0, Q.F16: 2**-11, Q.BF16: 2**-8, Q.Q8_0: 1 / 200, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15}
TOKENS = [1, 17, 255, 3, 99, 401, 42, 7, 300, 12, 5]


def tiny_hf_model(config: ModelConfig) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_config())
    return transformers.AutoModelForCausalLM.from_config(hf_config).eval()


def hf_weights(model: transformers.PreTrainedModel, config: ModelConfig) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.fixture(scope="module")
def tiny_config() -> ModelConfig:
    # A Llama with GQA 2:1 and a non-default theta, small enough to write in milliseconds;
    # theta and eps are exact in float32, as GGUF stores them.
    return replace(PRESETS["tiny"], rope_theta=50000.0, rms_norm_eps=2.0**-16)


@pytest.mark.parametrize("matrix_type", list(RELATIVE_ROUNDING), ids=lambda t: t.name)
def test_gguf_weights_come_back_unpermuted_within_rounding(tmp_path: Path, tiny_config, matrix_type):
    hf_model = tiny_hf_model(tiny_config)
    original = hf_weights(hf_model, tiny_config)
    path = tmp_path / f"tiny-{matrix_type.name}.gguf"
    write_llama_gguf(path, tiny_config, original, matrix_type)

    assert read_gguf_config(open_gguf(path)) == tiny_config
    ours = resolve_model(str(path)).load_model()
    loaded = dict(ours.named_parameters())
    c = tiny_config
    for layer in range(c.num_layers):
        fused_qkv = loaded[f"layers.{layer}.attn.qkv_proj.weight"]
        prefix = f"model.layers.{layer}.self_attn"
        for part, rows in zip("qkv", fused_qkv.split([c.q_size, c.kv_size, c.kv_size]), strict=True):
            assert_within_rounding(rows, original[f"{prefix}.{part}_proj.weight"], matrix_type)
    assert_within_rounding(loaded["embed_tokens.weight"], original["model.embed_tokens.weight"], matrix_type)


@pytest.mark.parametrize("matrix_type", list(RELATIVE_ROUNDING), ids=lambda t: t.name)
def test_gguf_logits_match_transformers_loading_the_same_file(tmp_path: Path, tiny_config, matrix_type):
    path = tmp_path / f"tiny-{matrix_type.name}.gguf"
    write_llama_gguf(path, tiny_config, hf_weights(tiny_hf_model(tiny_config), tiny_config), matrix_type)
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        reference = reference_model(torch.tensor([TOKENS])).logits[0]
    runner = ModelRunner(resolve_model(str(path)).load_model(), num_device_blocks=4, num_host_blocks=0, block_size=4)
    ours = runner.forward([ScheduledRequest("r0", TOKENS, 0, [3, 0, 2])])
    error = (ours - reference).abs().amax() / reference.abs().amax()
    assert error < 1e-4


def test_rotary_row_permutation_round_trips_and_really_permutes():
    weights = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    permuted = permute_rotary_rows(weights, num_heads=2)
    assert not np.array_equal(permuted, weights)
    # Head 0 rows [0..5] = pairs (x0, x1, x2 | y0, y1, y2) interleave to x0, y0, x1, y1, x2, y2.
    assert permuted[:6, 0].tolist() == [0.0, 9.0, 3.0, 12.0, 6.0, 15.0]
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, num_heads=2), weights)


def test_unsupported_tensor_type_is_a_clear_error(tmp_path: Path, tiny_config):
    path = tmp_path / "q5.gguf"
    write_llama_gguf(path, tiny_config, hf_weights(tiny_hf_model(tiny_config), tiny_config), Q.Q5_0)
    with pytest.raises(ValueError, match="has type Q5_0; supported"):
        resolve_model(str(path)).load_model()


def assert_within_rounding(loaded: torch.Tensor, original: torch.Tensor, matrix_type: Q) -> None:
    assert loaded.shape == original.shape
    blocks_loaded = loaded.detach().reshape(-1, 32)
    blocks_original = original.detach().reshape(-1, 32)
    block_scale = blocks_original.abs().amax(dim=1, keepdim=True)
    error = (blocks_loaded - blocks_original).abs()
    # Slack of 1.01 for the float16 block scales (Q8_0 has it in its bound: 127 steps of a rounded scale).
    assert (error <= block_scale * RELATIVE_ROUNDING[matrix_type] * 1.01 + 1e-7).all(), (
        f"{matrix_type.name}: worst error {(error / block_scale).max():.3g} of the block scale"
    )
