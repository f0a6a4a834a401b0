from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.model.packed_linear import PackedLinear, pack_linear_layers, packing_applies
from engine.model.registry import resolve_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_the_plain_product(dtype, num_rows, with_bias):
    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(num_rows, 80, generator=generator).to(dtype)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = PackedLinear(weight, bias)(x)
    assert got.dtype == dtype
    assert got.shape == (num_rows, 96)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1  # bfloat16 keeps 8 bits of mantissa in the output
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_packing_a_model_replaces_every_linear_and_keeps_its_outputs():
    source = resolve_model("random:tiny")
    plain, packed = source.load_model(seed=3), source.load_model(seed=3)
    packed.pack_linear_weights()
    plain_linears = {name: m for name, m in plain.named_modules() if isinstance(m, nn.Linear)}
    assert plain_linears
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    packed_modules = dict(packed.named_modules())
    x = torch.randn(5, plain.config.hidden_size)
    for name, linear in plain_linears.items():
        layer_input = torch.randn(5, linear.in_features)
        assert isinstance(packed_modules[name], PackedLinear)
        torch.testing.assert_close(packed_modules[name](layer_input), linear(layer_input), rtol=1e-5, atol=1e-5)
    # The tied head gets its own packed copy; the embedding matrix stays a plain parameter for the lookup.
    assert plain.config.tie_word_embeddings
    assert isinstance(packed.lm_head, PackedLinear)
    torch.testing.assert_close(packed.compute_logits(x), plain.compute_logits(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.embed_tokens.weight, plain.embed_tokens.weight)
    assert pack_linear_layers(packed) == 0  # packing twice changes nothing


def test_packing_applies_to_float32_and_bfloat16_on_the_cpu_only():
    cpu = torch.device("cpu")
    assert packing_applies(cpu, torch.float32)
    assert packing_applies(cpu, torch.bfloat16)
    assert not packing_applies(cpu, torch.float16)
    assert not packing_applies(torch.device("cuda"), torch.float32)
