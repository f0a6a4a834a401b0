from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.model.packed_linear import (
    MOST_ROWS_PER_CALL,
    ROW_GRANULE,
    TILE_LAYOUT,
    WEIGHT_LAYOUTS,
    PackedLinear,
    PackedSwiGLU,
    RowRange,
    choose_layout,
    choose_row_range,
    describe_packed_matmuls,
    pack_linear_layers,
    packing_applies,
    probe_row_ranges,
    probed_row_counts,
    set_batch_invariant,
    tile_matmul_name,
)
from engine.model.registry import resolve_model
from kernels.cpu_isa import visible_cpu_flags
from kernels.cpu_matmul import tile_matmul_isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("in_features", [80, 96])  # 96 fits the tile matmuls (inputs in 32s), 80 does not
@pytest.mark.parametrize("kernel", ["auto", "onednn"])
def test_packed_linear_matches_the_plain_product(dtype, num_rows, with_bias, in_features, kernel):
    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, in_features, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
    tiles = kernel == "auto" and dtype == torch.bfloat16 and in_features == 96 and tile_matmul_isa() is not None
    if not packing_applies(torch.device("cpu"), dtype) and not tiles:  # this CPU cannot: the runner must not try
        with pytest.raises(RuntimeError, match="bf16 path needs the cpu support"):
            PackedLinear(weight, bias, kernel=kernel)
        return
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    layer = PackedLinear(weight, bias, kernel=kernel)
    assert (layer.layout == TILE_LAYOUT) == tiles
    got = layer(x)
    assert got.dtype == dtype
    assert got.shape == (num_rows, 96)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1  # bfloat16 keeps 8 bits of mantissa in the output
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_packing_a_model_replaces_every_linear_and_keeps_its_outputs():
    source = resolve_model("random:tiny")
    plain, packed = source.load_model(seed=3), source.load_model(seed=3)
    packed.pack_linear_weights()
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    x, residual = torch.randn(5, plain.config.hidden_size), torch.randn(5, plain.config.hidden_size)
    for plain_layer, packed_layer in zip(plain.layers, packed.layers, strict=True):
        for name in ("qkv_proj", "o_proj"):
            linear, packed_linear = getattr(plain_layer.attn, name), getattr(packed_layer.attn, name)
            assert isinstance(packed_linear, PackedLinear)
            layer_input = torch.randn(5, linear.in_features)
            torch.testing.assert_close(packed_linear(layer_input), linear(layer_input), rtol=1e-5, atol=1e-5)
        assert isinstance(packed_layer.mlp, PackedSwiGLU)
        torch.testing.assert_close(packed_layer.mlp(x, residual), plain_layer.mlp(x, residual), rtol=1e-5, atol=1e-5)
    # The tied head gets its own packed copy; the embedding matrix stays a plain parameter for the lookup.
    assert plain.config.tie_word_embeddings
    assert isinstance(packed.lm_head, PackedLinear)
    torch.testing.assert_close(packed.compute_logits(x), plain.compute_logits(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.embed_tokens.weight, plain.embed_tokens.weight)
    assert pack_linear_layers(packed) == 0  # packing twice changes nothing


@pytest.mark.parametrize("kernel", ["auto", "onednn"])
def test_a_bfloat16_head_gives_float32_logits_near_the_exact_product(kernel):
    """Rounded to bfloat16, a logit of about 25 moves by up to 1/16: near-ties between tokens would tie or flip."""
    if not packing_applies(torch.device("cpu"), torch.bfloat16) and tile_matmul_isa() is None:
        pytest.skip("this CPU packs no bfloat16 weights")
    source = resolve_model("random:tiny")
    model = source.load_model(dtype=torch.bfloat16, seed=3)
    model.pack_linear_weights(kernel=kernel)
    x = (8 * torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    exact = x.double() @ model.embed_tokens.weight.double().T
    logits = model.compute_logits(x)
    assert logits.dtype == torch.float32
    # Either kernel: far closer than bfloat16's own rounding of the result (2^-9 of each value).
    assert ((logits.double() - exact).abs() <= exact.abs() * 2**-14 + 1e-5 * exact.abs().max()).all()


def test_packed_swiglu_is_the_gated_mlp_plus_the_residual():
    generator = torch.Generator().manual_seed(0)
    gate, up = torch.randn(48, 32, generator=generator), torch.randn(48, 32, generator=generator)
    down = torch.randn(32, 48, generator=generator)
    x, residual = torch.randn(9, 32, generator=generator), torch.randn(9, 32, generator=generator)
    x64 = x.double()
    expected = residual.double() + F.silu(x64 @ gate.double().T) * (x64 @ up.double().T) @ down.double().T
    torch.testing.assert_close(PackedSwiGLU(gate, up, down)(x, residual).double(), expected, rtol=1e-4, atol=1e-3)


# float32 always; bfloat16 where this CPU packs it (elsewhere the runner never builds a packed bfloat16 layer).
@pytest.mark.parametrize(
    "dtype", [dtype for dtype in (torch.float32, torch.bfloat16) if packing_applies(torch.device("cpu"), dtype)]
)
@pytest.mark.parametrize("favour", ["throughput", "latency"])
@pytest.mark.parametrize("kernel", ["auto", "onednn"])
def test_a_row_comes_out_the_same_whatever_the_batch_around_it(dtype, favour, kernel):
    # The model's down projection (K = 1536) and its fused MLP: oneDNN multiplies a lone row with another kernel,
    # and on a CPU with AMX bfloat16 from 33 rows on with others again (the layers pad and slice their rows, as
    # probed: 1 row -> 33 or 37 there, 65 -> 80, 300 -> 240 + 60 padded to 64); packed for latency there, in the
    # "vector" layout, they run every count alone up to 144 or 256 rows. "auto" takes kvstorm's tile matmuls wherever
    # the CPU has AMX or AVX512-BF16, invariant at any count without padding or slicing.
    generator = torch.Generator().manual_seed(1)
    down = PackedLinear((torch.randn(576, 1536, generator=generator) / 20).to(dtype), favour=favour, kernel=kernel)
    mlp = PackedSwiGLU(
        *((torch.randn(*shape, generator=generator) / 20).to(dtype) for shape in ((1536, 576),) * 2 + ((576, 1536),)),
        favour=favour,
        kernel=kernel,
    )
    hidden = torch.randn(300, 1536, generator=generator).to(dtype)
    x, residual = (torch.randn(300, 576, generator=generator).to(dtype) for _ in range(2))
    set_batch_invariant(nn.ModuleList([down, mlp]), True, favour)
    for rows in (2, 3, 17, 33, 65, 145, 300):
        assert torch.equal(down(hidden[:1])[0], down(hidden[:rows])[0]), rows
        assert torch.equal(mlp(x[:1], residual[:1])[0], mlp(x[:rows], residual[:rows])[0]), rows
        assert torch.equal(down(hidden[rows - 1 : rows])[0], down(hidden[:rows])[rows - 1]), rows


def test_throughput_takes_the_widest_range_and_latency_the_first_that_holds_a_batch():
    amx_bfloat16 = (RowRange(1, 32), RowRange(33, 33), RowRange(37, 240))
    assert choose_row_range(amx_bfloat16, "throughput") == RowRange(37, 240)
    assert choose_row_range(amx_bfloat16, "latency") == RowRange(1, 32)
    lone_row_apart = (RowRange(1, 1), RowRange(2, 256))  # float32 at K = 1536: not a range of single rows
    assert choose_row_range(lone_row_apart, "latency") == choose_row_range(lone_row_apart, "throughput")
    assert choose_row_range((RowRange(1, 8), RowRange(9, 12)), "latency") == RowRange(1, 8)  # none spans 16
    with pytest.raises(ValueError, match="invariant_rows must be one of"):
        choose_row_range(amx_bfloat16, "fastest")


@pytest.mark.parametrize(
    "dtype", [dtype for dtype in (torch.float32, torch.bfloat16) if packing_applies(torch.device("cpu"), dtype)]
)
def test_the_model_mlp_runs_a_lone_row_unpadded_for_latency_and_in_the_widest_range_for_throughput(dtype):
    generator = torch.Generator().manual_seed(3)
    mlp = PackedSwiGLU(
        *(torch.randn(*shape, generator=generator).to(dtype) for shape in ((1536, 576),) * 2 + ((576, 1536),)),
        kernel="onednn",
    )
    latency = set_batch_invariant(mlp, True, "latency")
    assert latency.fewest <= 2  # one row, or two where a lone row has a kernel of its own
    assert latency.width >= ROW_GRANULE
    throughput = set_batch_invariant(mlp, True, "throughput")
    assert throughput.width >= latency.width
    # Each half in its own widest range (on AMX in bfloat16 the gate and up projections from 33 rows, the down
    # projection from 37), and what the model reports is where both hold.
    halves = (mlp.swiglu, mlp.residual_down)
    for half in halves:
        assert half.row_range == max(half.invariant_row_ranges, key=lambda r: r.width)
    assert throughput == (max(h.row_range.fewest for h in halves), min(h.row_range.most for h in halves))


def lone_row_key(layout, shape, dtype):
    """How well the range a latency-favouring layer of this layout takes serves a lone decode: the lower its first
    count and then the more counts it spans, the better."""
    chosen = choose_row_range(probe_row_ranges(*shape, False, dtype, layout), "latency")
    return -chosen.fewest, chosen.width


@pytest.mark.parametrize(
    "dtype", [dtype for dtype in (torch.float32, torch.bfloat16) if packing_applies(torch.device("cpu"), dtype)]
)
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576)])  # the MLP's gate/up and down projections
def test_latency_packs_each_weight_in_the_layout_best_for_a_lone_decode_and_throughput_in_the_batch_layout(
    dtype, shape
):
    assert choose_layout(*shape, False, dtype, "throughput") == "batch"
    chosen = choose_layout(*shape, False, dtype, "latency")
    keys = {layout: lone_row_key(layout, shape, dtype) for layout in WEIGHT_LAYOUTS}
    assert keys[chosen] == max(keys.values())
    if dtype == torch.bfloat16 and "amx_bf16" in visible_cpu_flags():
        # The batch layout's kernels change at 33 rows; the vector layout's agree from one row up to 256 (144 at
        # K = 1536), so a latency-favouring layer runs a lone row alone and a batch in few calls.
        assert probe_row_ranges(*shape, False, dtype, "batch")[0] == RowRange(1, 32)
        assert chosen == "vector"
        assert probe_row_ranges(*shape, False, dtype, "vector")[0] == RowRange(1, 256 if shape[0] == 576 else 144)
    weights = (torch.randn(*s).to(dtype) for s in ((1536, 576),) * 2 + ((576, 1536),))
    mlp = PackedSwiGLU(*weights, favour="latency", kernel="onednn")
    half = mlp.swiglu if shape == (576, 1536) else mlp.residual_down
    assert half.layout == chosen
    set_batch_invariant(mlp, True, "latency")
    assert half.row_range == choose_row_range(probe_row_ranges(*shape, False, dtype, chosen), "latency")


@pytest.mark.parametrize("favour", ["throughput", "latency"])
def test_a_result_stays_what_it_was_when_later_calls_pad_their_rows(favour):
    # Padded calls share one buffer per argument: a result must never be a view of it.
    generator = torch.Generator().manual_seed(4)
    mlp = PackedSwiGLU(*(torch.randn(*shape, generator=generator) for shape in ((1536, 576),) * 2 + ((576, 1536),)))
    linear = PackedLinear(torch.randn(960, 576, generator=generator))
    set_batch_invariant(nn.ModuleList([mlp, linear]), True, favour)
    x, residual = (torch.randn(40, 576, generator=generator) for _ in range(2))
    results = [mlp(x[:1], residual[:1]), linear(x[:1]), mlp(x[:17], residual[:17]), linear(x[:33])]
    kept = [result.clone() for result in results]
    for rows in (1, 17, 33, 40):
        mlp(x[rows - 1 :] * 3, residual[rows - 1 :])
        linear(-x[rows - 1 :])
    assert all(torch.equal(result, copy) for result, copy in zip(results, kept, strict=True))


@pytest.mark.parametrize("first_in_inference_mode", [True, False])
def test_padded_calls_run_inside_and_outside_inference_mode_in_either_order(first_in_inference_mode):
    # The engine runs under inference mode, tests and scripts outside it. Padding buffers are per thread, so in a
    # fresh thread the first padded call (17 rows: padded to 32 on any CPU) creates them.
    generator = torch.Generator().manual_seed(5)
    weight, x = torch.randn(96, 64, generator=generator), torch.randn(17, 64, generator=generator)
    linear = PackedLinear(weight)
    set_batch_invariant(linear, True)
    results: list[torch.Tensor] = []

    def call_in_both_modes() -> None:
        for inference in (first_in_inference_mode, not first_in_inference_mode):
            with torch.inference_mode(inference):
                results.append(linear(x))

    thread = threading.Thread(target=call_in_both_modes)
    thread.start()
    thread.join()
    assert len(results) == 2
    for result in results:
        torch.testing.assert_close(result, x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fewest", [1, 2, 16, 17, 33, 37, 250])
def test_calls_are_given_only_row_counts_the_probe_checked(fewest):
    # A range the probe finds ends at a count it checked; every call of its layer must then be one of those counts.
    checked = probed_row_counts(fewest)
    for most in checked:
        given = {RowRange(fewest, most).padded(rows) for rows in range(1, most + 1)}
        assert given <= {count for count in checked if count <= most}, (fewest, most)
        assert (min(given), max(given)) == (fewest, most)
    assert len({count for count in checked if count > 16}) <= 16  # few kernels per shape: oneDNN caches each


def test_batch_invariance_turns_off_and_either_way_the_product_is_right():
    generator = torch.Generator().manual_seed(2)
    weight, x = torch.randn(96, 64, generator=generator), torch.randn(600, 64, generator=generator)
    layer = PackedLinear(weight)
    fewest, most = layer.invariant_row_range
    assert 1 <= fewest < most <= MOST_ROWS_PER_CALL
    assert set_batch_invariant(layer, True) == layer.row_range == layer.invariant_row_range
    sliced = layer(x)
    assert set_batch_invariant(layer, False) is None
    assert layer.row_range is None
    torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sliced, x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["auto", "onednn"])
def test_a_packed_model_says_what_multiplies_it_and_in_calls_of_how_many_rows(kernel):
    model = resolve_model("random:tiny").load_model(dtype=torch.bfloat16, seed=0)
    tiles = kernel == "auto" and tile_matmul_isa() is not None
    if not packing_applies(torch.device("cpu"), torch.bfloat16) and not tiles:  # the runner must not try
        with pytest.raises(RuntimeError, match="bf16 path needs the cpu support"):
            model.pack_linear_weights(kernel=kernel)
        return
    model.pack_linear_weights(kernel=kernel)
    layers = [m for m in model.modules() if hasattr(m, "layout")]
    assert layers
    assert all((layer.layout == TILE_LAYOUT) == tiles for layer in layers)
    rows = set_batch_invariant(model, True)
    if tiles:  # no layer pads or slices its calls
        assert rows is None
        assert tile_matmul_name() == f"kvstorm-{tile_matmul_isa()}"
        assert describe_packed_matmuls(model, True, rows) == f"{tile_matmul_name()}, batch-invariant at any row count"
    else:
        assert describe_packed_matmuls(model, True, rows) == (
            f"onednn-packed, batch-invariant in calls of {rows.fewest}-{rows.most} rows"
        )
    assert set_batch_invariant(model, False) is None
    assert describe_packed_matmuls(model, False, None) == (tile_matmul_name() if tiles else "onednn-packed")


def test_packing_applies_to_float32_and_to_bfloat16_where_the_cpu_has_the_instructions():
    cpu = torch.device("cpu")
    flags = visible_cpu_flags()
    assert packing_applies(cpu, torch.float32)
    has_bfloat16_path = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert packing_applies(cpu, torch.bfloat16) == has_bfloat16_path
    assert not packing_applies(cpu, torch.float16)
    assert not packing_applies(torch.device("cuda"), torch.float32)
