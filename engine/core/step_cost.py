"""What one engine step costs in time, without running it: the simulator's stand-in for the model runner.

A step is described by its shape (``StepShape``): prompt tokens it computes, decode rows, the KV tokens its attention
reads and the (query, key) pairs it scores. Two models price a shape:

- ``LinearStepCost``: a fixed cost plus a cost per unit of each feature, fitted by non-negative least squares to steps
  the real engine ran on this machine (``fit_linear_step_cost``; ``kvstorm simulate profile`` measures them).
- ``RooflineStepCost``: a GPU and a model on paper. A step reads the weights once and the KV its attention needs,
  and computes two FLOPs per parameter per token plus its attention; it takes the longer of its memory time and its
  compute time at stated efficiencies, plus a fixed overhead, plus the all-reduces of tensor parallelism. A
  prediction, not a measurement: every number it rests on is in its profile.

Block moves (swap) cost ``swap_block_s`` per block, one way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np


class StepShape(NamedTuple):
    """One step as its cost sees it (a tuple: the simulator makes one for every step it prices). A decode is a row of
    one new token; every other row's tokens count as prefill (a prompt chunk, or a recompute).
    ``num_context_tokens``: KV tokens the step's rows hold after it (what its attention reads);
    ``num_attended_pairs``: the (new token, key) pairs its attention scores."""

    num_prefill_tokens: int
    num_decodes: int
    num_context_tokens: int
    num_attended_pairs: int

    @classmethod
    def of_batch(cls, rows: Iterable[tuple[int, int]]) -> StepShape:
        """From ``(num_computed_tokens before the step, num_new_tokens)`` per row."""
        # The engine counts every step it runs (LLMEngine._record): a decode row, most of a big batch, takes the
        # short branch, and its context and pairs are both computed + 1, summed once at the end.
        prefill = decodes = decode_computed = prefill_context = prefill_pairs = 0
        for computed, new in rows:
            if new == 1:
                decodes += 1
                decode_computed += computed
            else:
                prefill += new
                prefill_context += computed + new
                # New token j (0-based) of the row attends to computed + j + 1 keys.
                prefill_pairs += new * computed + new * (new + 1) // 2
        decode_context = decode_computed + decodes
        return cls(prefill, decodes, decode_context + prefill_context, decode_context + prefill_pairs)


# What a linear step cost has a coefficient for, in order.
FEATURES = StepShape._fields


@dataclass(frozen=True)
class LinearStepCost:
    """``per_step_s + sum(coefficient * feature)``, coefficients >= 0, per ``FEATURES``; ``swap_block_s`` per block
    moved one way."""

    per_step_s: float
    per_prefill_token_s: float
    per_decode_s: float
    per_context_token_s: float
    per_attended_pair_s: float
    swap_block_s: float

    def step_s(self, shape: StepShape) -> float:
        return (
            self.per_step_s
            + self.per_prefill_token_s * shape.num_prefill_tokens
            + self.per_decode_s * shape.num_decodes
            + self.per_context_token_s * shape.num_context_tokens
            + self.per_attended_pair_s * shape.num_attended_pairs
        )

    def to_json(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class FitQuality:
    """How well a fitted model predicts the steps it was fitted to (relative errors, |predicted - measured| /
    measured)."""

    num_steps: int
    median_relative_error: float
    p90_relative_error: float
    total_relative_error: float  # of the summed time of all steps: what a throughput prediction inherits


def fit_linear_step_cost(
    shapes: Sequence[StepShape], durations_s: Sequence[float], swap_block_s: float
) -> tuple[LinearStepCost, FitQuality]:
    """Non-negative least squares over relative errors (each step weighs alike, a 2 ms decode as much as a 300 ms
    prefill): every subset of the features is solved and the best one with no negative coefficient kept."""
    if len(shapes) != len(durations_s) or len(shapes) < len(FEATURES) + 1:
        raise ValueError(f"need at least {len(FEATURES) + 1} measured steps, got {len(shapes)}")
    x = np.array([(1.0, *shape) for shape in shapes], dtype=float)
    y = np.array(durations_s, dtype=float)
    if not np.all(y > 0):
        raise ValueError("every measured step must have a positive duration")
    weights = 1.0 / y
    best, best_error = None, math.inf
    for size in range(1, x.shape[1] + 1):
        for columns in itertools.combinations(range(x.shape[1]), size):
            solution, *_ = np.linalg.lstsq(x[:, columns] * weights[:, None], y * weights, rcond=None)
            if np.any(solution < 0):
                continue
            coefficients = np.zeros(x.shape[1])
            coefficients[list(columns)] = solution
            error = float(np.sum(((x @ coefficients - y) * weights) ** 2))
            if error < best_error:
                best, best_error = coefficients, error
    assert best is not None  # the constant alone is always feasible: durations are positive
    cost = LinearStepCost(*(float(c) for c in best), swap_block_s=swap_block_s)
    predicted = x @ best
    relative = np.abs(predicted - y) / y
    quality = FitQuality(
        num_steps=len(shapes),
        median_relative_error=float(np.median(relative)),
        p90_relative_error=float(np.quantile(relative, 0.9)),
        total_relative_error=float(abs(predicted.sum() - y.sum()) / y.sum()),
    )
    return cost, quality


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    memory_bytes_per_s: float
    # Dense matrix throughput in the model's dtype, without sparsity.
    flops_per_s: float
    # Host <-> device copies (swap), one direction.
    host_link_bytes_per_s: float
    # GPU <-> GPU for tensor parallelism's all-reduces, one direction, and the latency of one all-reduce.
    interconnect_bytes_per_s: float
    all_reduce_latency_s: float


@dataclass(frozen=True)
class Model:
    name: str
    num_parameters: float
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_value: int

    # Cached: a roofline reads both for every step it prices.
    @cached_property
    def weight_bytes(self) -> float:
        return self.num_parameters * self.bytes_per_value

    @cached_property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_value


@dataclass(frozen=True)
class RooflineStepCost:
    """One step of ``model`` on ``tensor_parallel`` GPUs, each holding 1/tp of the weights and of the KV heads."""

    gpu: Gpu
    model: Model
    tensor_parallel: int
    block_size: int
    # Shares of the peak a real step reaches: of the memory bandwidth, of the FLOP rate.
    memory_efficiency: float
    compute_efficiency: float
    # What a step costs whatever its size: scheduling, input preparation, kernel launches, sampling.
    per_step_s: float

    def step_s(self, shape: StepShape) -> float:
        # A simulation prices every step it runs: the constants are worked out once, with the same operations.
        tp, weight_bytes, kv_bytes_per_token, bytes_per_s, flops_per_token, attention_flops_per_pair, flops_per_s = (
            self._constants
        )
        num_tokens = shape.num_prefill_tokens + shape.num_decodes
        read_bytes = (weight_bytes + shape.num_context_tokens * kv_bytes_per_token) / tp
        memory_s = read_bytes / bytes_per_s
        flops = (flops_per_token * num_tokens + attention_flops_per_pair * shape.num_attended_pairs) / tp
        compute_s = flops / flops_per_s
        step_s = self.per_step_s + max(memory_s, compute_s)
        return step_s if tp == 1 else step_s + self._all_reduce_s(num_tokens)

    @cached_property
    def _constants(self) -> tuple[int, float, int, float, float, int, float]:
        model, gpu = self.model, self.gpu
        return (
            self.tensor_parallel,
            model.weight_bytes,
            model.kv_bytes_per_token,
            gpu.memory_bytes_per_s * self.memory_efficiency,
            2 * model.num_parameters,
            4 * model.num_layers * model.num_attention_heads * model.head_dim,
            gpu.flops_per_s * self.compute_efficiency,
        )

    def _all_reduce_s(self, num_tokens: int) -> float:
        """Two all-reduces of the hidden state per layer (after attention, after the MLP), ring algorithm."""
        tp = self.tensor_parallel
        if tp == 1 or num_tokens == 0:
            return 0.0
        ring_bytes = 2 * (tp - 1) / tp * num_tokens * self.model.hidden_size * self.model.bytes_per_value
        one_s = self.gpu.all_reduce_latency_s + ring_bytes / self.gpu.interconnect_bytes_per_s
        return 2 * self.model.num_layers * one_s

    @property
    def bytes_per_block(self) -> int:
        """One block of every layer, over all GPUs (each holds 1/tp of it)."""
        return self.block_size * self.model.kv_bytes_per_token

    @property
    def swap_block_s(self) -> float:
        """Each GPU moves its share of a block over its own host link, at once."""
        return self.bytes_per_block / self.tensor_parallel / self.gpu.host_link_bytes_per_s

    def num_kv_blocks(self, memory_utilization: float, activation_reserve_bytes: float) -> int:
        """The KV pool that fits beside the weights and an activation reserve in ``memory_utilization`` of each
        GPU's memory."""
        per_gpu = (
            self.gpu.memory_bytes * memory_utilization
            - self.model.weight_bytes / self.tensor_parallel
            - activation_reserve_bytes
        )
        if per_gpu <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.tensor_parallel} x {self.gpu.name}")
        return int(per_gpu // (self.bytes_per_block / self.tensor_parallel))
