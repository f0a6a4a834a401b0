"""Step-cost models: a step's shape counted from its rows, the fit recovering known costs, and the roofline's arithmetic
on the shipped H200 profile's numbers."""

from __future__ import annotations

import random

import pytest

from engine.core.step_cost import (
    FEATURES,
    Gpu,
    LinearStepCost,
    Model,
    RooflineStepCost,
    StepShape,
    fit_linear_step_cost,
)


def test_a_steps_shape_counts_prefill_decodes_context_and_attended_pairs():
    # A 4-token chunk after 10 computed tokens, and two decodes at contexts 7 and 20.
    shape = StepShape.of_batch([(10, 4), (6, 1), (19, 1)])
    assert shape.num_prefill_tokens == 4
    assert shape.num_decodes == 2
    assert shape.num_context_tokens == 14 + 7 + 20
    # The chunk's tokens attend to 11, 12, 13 and 14 keys; each decode to its whole context.
    assert shape.num_attended_pairs == (11 + 12 + 13 + 14) + 7 + 20


def random_shapes(count: int, seed: int) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        rows = [(rng.randint(0, 900), 1) for _ in range(rng.randint(0, 40))]
        rows += [(rng.randint(0, 300), rng.randint(2, 512)) for _ in range(rng.randint(0, 2))]
        shapes.append(StepShape.of_batch(rows or [(0, 1)]))
    return shapes


def test_the_fit_recovers_the_costs_that_made_the_steps():
    truth = LinearStepCost(0.009, 5e-4, 5e-4, 7e-7, 4e-7, swap_block_s=1e-4)
    shapes = random_shapes(300, seed=0)
    cost, quality = fit_linear_step_cost(shapes, [truth.step_s(s) for s in shapes], swap_block_s=1e-4)
    assert cost.to_json() == pytest.approx(truth.to_json(), rel=1e-6)
    assert quality.median_relative_error < 1e-9
    assert quality.num_steps == 300


def test_the_fit_keeps_every_cost_non_negative_under_noise():
    truth = LinearStepCost(0.02, 1e-3, 0.0, 0.0, 0.0, swap_block_s=0.0)
    shapes = random_shapes(200, seed=1)
    rng = random.Random(2)
    measured = [truth.step_s(s) * rng.uniform(0.9, 1.1) for s in shapes]
    cost, quality = fit_linear_step_cost(shapes, measured, swap_block_s=0.0)
    assert all(value >= 0 for value in cost.to_json().values())
    assert quality.median_relative_error < 0.1
    assert quality.total_relative_error < 0.05


def test_the_fit_needs_more_steps_than_costs():
    with pytest.raises(ValueError, match="at least"):
        fit_linear_step_cost(random_shapes(len(FEATURES), seed=0), [0.01] * len(FEATURES), swap_block_s=0.0)


H200 = Gpu("H200", 141e9, 4.8e12, 989e12, 50e9, 360e9, 15e-6)
LLAMA_8B = Model("Llama-3-8B", 8.03e9, 32, 4096, 32, 8, 128, 2)


def test_a_small_decode_is_memory_bound_and_a_long_prefill_compute_bound():
    cost = RooflineStepCost(H200, LLAMA_8B, 1, 16, memory_efficiency=0.8, compute_efficiency=0.6, per_step_s=0.002)
    weights_s = 8.03e9 * 2 / (4.8e12 * 0.8)
    assert cost.step_s(StepShape.of_batch([(0, 1)])) == pytest.approx(0.002 + weights_s + 1 * 131072 / (4.8e12 * 0.8))
    prefill = StepShape.of_batch([(0, 4096)])
    flops = 2 * 8.03e9 * 4096 + 4 * 32 * 32 * 128 * prefill.num_attended_pairs
    assert cost.step_s(prefill) == pytest.approx(0.002 + flops / (989e12 * 0.6))


def test_tensor_parallelism_splits_weights_and_kv_and_adds_two_all_reduces_per_layer():
    one = RooflineStepCost(H200, LLAMA_8B, 1, 16, 0.8, 0.6, 0.0)
    eight = RooflineStepCost(H200, LLAMA_8B, 8, 16, 0.8, 0.6, 0.0)
    decode = StepShape.of_batch([(1000, 1)] * 8)
    ring_bytes = 2 * 7 / 8 * 8 * 4096 * 2
    all_reduces = 2 * 32 * (15e-6 + ring_bytes / 360e9)
    assert eight.step_s(decode) == pytest.approx(one.step_s(decode) / 8 + all_reduces)
    assert eight.swap_block_s == pytest.approx(one.swap_block_s / 8)


def test_the_kv_pool_is_what_fits_beside_the_weights():
    cost = RooflineStepCost(H200, LLAMA_8B, 1, 16, 0.8, 0.6, 0.002)
    assert cost.bytes_per_block == 16 * 131072
    assert cost.num_kv_blocks(0.9, 2e9) == int((141e9 * 0.9 - 8.03e9 * 2 - 2e9) // (16 * 131072))
    with pytest.raises(ValueError, match="does not fit"):
        cost.num_kv_blocks(0.1, 0)
