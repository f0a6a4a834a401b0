"""The real model in bfloat16 with each decoder layer in one call of the compiled CPU kernels computes the same bits
as its modules called one by one: every position's logits and every K/V written to the cache, over prefill chunks
of two requests and then their decodes in one batch."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.core.outputs import ScheduledRequest
from engine.model_runner import ModelRunner
from kernels.cpu_matmul import tile_matmul_isa


@pytest.fixture(scope="module")
def runner(real_source):
    model = real_source.load_model(dtype=torch.bfloat16, device="cpu", backend=CpuAttentionBackend())
    return ModelRunner(model, num_device_blocks=8, num_host_blocks=0, block_size=16)


def steps(runner: ModelRunner, one_call: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of every position of a prefill step (two prompts, the second after part of it was computed) and a
    decode step of both, and the cache afterwards."""
    for layer in runner.model.layers:
        layer.runs_as_one_call = one_call
    runner.device_cache.data.zero_()
    prompt = [(7 * i + 3) % 4000 for i in range(53)]
    prefill = [
        ScheduledRequest("a", prompt[:37], 0, [0, 1, 2]),
        ScheduledRequest("b", prompt[20:53], 0, [3, 4, 5]),
    ]
    decode = [ScheduledRequest("a", [11], 37, [0, 1, 2]), ScheduledRequest("b", [12], 33, [3, 4, 5])]
    logits = [runner.forward(prefill), runner.forward(decode)]
    return logits, runner.device_cache.data.clone()


def test_a_decoder_layer_in_one_call_is_the_same_bits_as_its_modules(runner):
    assert runner.model.layers[0].runs_as_one_call == (tile_matmul_isa() is not None)
    if tile_matmul_isa() is None:  # oneDNN's matmuls: the modules run one by one
        assert runner.layer_ops == "cpu-kernels"
        return
    assert runner.layer_ops == "cpu-kernels (a decoder layer per call)"
    one_call_logits, one_call_cache = steps(runner, one_call=True)
    module_logits, module_cache = steps(runner, one_call=False)
    assert one_call_cache.abs().sum() > 0  # both steps wrote keys and values
    assert torch.equal(one_call_cache, module_cache)
    for ours, theirs in zip(one_call_logits, module_logits, strict=True):
        assert ours.shape[0] in (70, 2)
        assert torch.equal(ours, theirs)
