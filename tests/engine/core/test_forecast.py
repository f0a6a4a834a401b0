"""The forecast is the scheduler run ahead: from a snapshot of a real engine it names the step of each new request's
first token exactly as the engine's scheduler then does, through preemptions by swap and by recompute, KV caps
(one that a request cannot fit under, one below what the block tables hold) and a host pool capped too."""

from __future__ import annotations

import math
import random

import pytest

from engine.core.forecast import forecast
from engine.core.outputs import RemainingWork
from engine.core.sampling_params import SamplingParams
from tests.engine.serving.conftest import make_tiny_engine


# One unit of time per step, whatever is in it: the forecast's times are then step counts.
def one_per_step(num_prefill_tokens: int, num_decodes: int) -> float:
    return 1.0


# Time that depends on what is in the step.
def by_shape(num_prefill_tokens: int, num_decodes: int) -> float:
    return 0.01 + 0.001 * num_prefill_tokens + 0.002 * num_decodes


# The faults set before the arrival at these loop indices (None: all off).
NO_CAPS: dict[int, dict | None] = {}
CAPS = {
    100: {"kv_cap": {"fraction": 0.6}},
    700: {"kv_cap": {"blocks": 30}, "swap_cap": {"blocks": 40}},  # (600, 16) needs 39 blocks: it waits for the lift
    760: None,
}
# (prompt tokens, max_tokens) of the arrivals.
SHAPES = [(256, 64), (100, 16), (400, 8), (600, 16)]


def prompt(rng: random.Random, index: int, prompt_len: int) -> list[int]:
    """The first half of one of three shared prefixes, then tokens of its own: hits of every length, whole blocks
    and not, from blocks held by running requests and from evictable ones."""
    family, shared = rng.randrange(3), prompt_len // 2
    return [1 + (family * 131 + i) % 500 for i in range(shared)] + [
        1 + (index * 7 + i) % 500 for i in range(prompt_len - shared)
    ]


@pytest.mark.parametrize(
    ("preemption_mode", "faults", "prefix_caching"),
    [
        ("swap", NO_CAPS, True),
        ("recompute", NO_CAPS, True),
        ("swap", CAPS, True),
        ("auto", CAPS, True),
        ("auto", CAPS, False),
    ],
)
def test_the_forecast_names_the_step_of_each_first_token_as_the_scheduler_then_does(
    preemption_mode, faults, prefix_caching
):
    """Requests arrive at random steps into an engine whose pool holds two or three at a time; for each, the
    forecast from the snapshot before it arrived names the step of its first token, unless a fault changed between
    that snapshot and the first token (the forecast cannot know a fault that is set later). Their prompts share
    prefixes: with prefix caching on, the forecast finds the hits the engine then finds. Planning every step of the
    forecast on its own gives the same forecast as taking runs of decode steps in one go."""
    engine = make_tiny_engine(
        kv_cache_memory=68 * 8192,
        swap_space=120 * 8192,
        max_num_batched_tokens=512,
        preemption_mode=preemption_mode,
        enable_prefix_caching=prefix_caching,
    )
    assert engine.info.bytes_per_block == 8192
    assert engine.stats().num_device_blocks == 68
    rng = random.Random(0)
    predicted, predicted_at, first_token_step, num_steps = {}, {}, {}, 0
    fault_changes, under_cap = [], set()
    for index in range(900):
        if index in faults:
            engine.update_faults(**(faults[index] or {"kv_cap": None, "swap_cap": None}))
            fault_changes.append(num_steps)
        if index in faults or rng.random() < 0.15:
            snapshot = engine.snapshot()
            in_progress = engine.has_unfinished_requests()
            if in_progress:  # a step on the snapshot runs while the request arrives, as in the server
                for output in engine.step().outputs:
                    first_token_step.setdefault(output.request_id, num_steps + 1)
                num_steps += 1
            request_id = f"r{index}"
            prompt_len, max_tokens = rng.choice(SHAPES)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            prepared = engine.prepare_request(prompt(rng, index, prompt_len), params, request_id=request_id)
            new = RemainingWork(prompt_len, 0, max_tokens, math.inf, block_hashes=prepared.block_hashes)
            ahead = forecast(snapshot, engine.info, [], [], new, one_per_step, horizon_s=2000).ttft_s
            # Runs of decode steps in one go decide and time as planning every step does, TPOT included.
            in_runs, step_by_step = (
                forecast(snapshot, engine.info, [], [], new, by_shape, horizon_s=2000, fast_forward=on)
                for on in (True, False)
            )
            assert in_runs == step_by_step
            predicted[request_id] = num_steps - in_progress + ahead
            predicted_at[request_id] = num_steps - in_progress
            stats = snapshot.stats
            if stats.num_device_blocks < stats.num_physical_device_blocks:
                under_cap.add(request_id)
            engine.add_prepared_request(prepared)
        for output in engine.step().outputs:
            if output.new_token_ids:
                first_token_step.setdefault(output.request_id, num_steps + 1)
        num_steps += 1
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            first_token_step.setdefault(output.request_id, num_steps + 1)
        num_steps += 1

    def unchanged(request_id: str) -> bool:
        return not any(predicted_at[request_id] < change < first_token_step[request_id] for change in fault_changes)

    compared = [r for r in predicted if unchanged(r)]
    misses = {r: (predicted[r], first_token_step[r]) for r in compared if predicted[r] != first_token_step[r]}
    assert not misses, f"forecast (steps) vs the engine: {misses}"
    stats = engine.stats()
    assert stats.num_preemptions >= 10
    assert len(compared) > 40
    if prefix_caching:
        assert stats.prefix_cache_hit_tokens > stats.prefix_cache_queried_tokens / 10
        assert stats.prefix_cache_evictions > 0
    if faults:
        assert len(under_cap & set(compared)) >= 20
        waited = [r for r in under_cap if not unchanged(r) and predicted[r] == math.inf]
        assert waited, "no request was forecast to wait for the cap to lift"


def test_a_queue_behind_a_busy_batch_waits_for_blocks_not_only_for_prefill():
    """Four requests decode in a pool with room for none more: the new one waits until they finish (30 more
    outputs each), where counting the prompts ahead alone would say it starts at once."""
    engine = make_tiny_engine(kv_cache_memory=24 * 8192, swap_space=0, max_num_batched_tokens=512)
    for index in range(4):
        engine.add_request(list(range(1, 81)), SamplingParams(max_tokens=31, ignore_eos=True), request_id=f"r{index}")
    engine.step()
    snapshot = engine.snapshot()
    assert snapshot.stats.num_free_device_blocks < 6  # 4 x 6 blocks of 16 tokens held
    new = RemainingWork(80, 0, 4, math.inf)
    predicted = forecast(snapshot, engine.info, [], [], new, one_per_step, horizon_s=1e9)
    assert predicted.queue_s == 30  # the step in progress and 29 more: the batch's last outputs free its blocks
    assert predicted.ttft_s == 31


def test_a_cap_below_what_the_block_tables_hold_preempts_in_the_forecast_as_in_the_engine():
    """Four requests hold 20 blocks when a cap of 14 arrives: the next step preempts the newest two (to the host),
    and the forecast from that snapshot, which knows the cap but not who will go, names the same first-token step
    for a new request as the engine then gives it."""
    engine = make_tiny_engine(
        kv_cache_memory=40 * 8192, swap_space=40 * 8192, max_num_batched_tokens=512, preemption_mode="swap"
    )
    for index in range(4):
        engine.add_request([1 + index] * 80, SamplingParams(max_tokens=40, ignore_eos=True), request_id=f"r{index}")
    engine.step()
    engine.update_faults(kv_cap={"blocks": 14})
    snapshot = engine.snapshot()
    assert snapshot.stats.num_used_device_blocks == 20 > snapshot.stats.num_device_blocks
    predicted = forecast(snapshot, engine.info, [], [], RemainingWork(60, 0, 4, math.inf), one_per_step, horizon_s=1e9)
    engine.step()  # the step on the snapshot runs while the request arrives, as in the server
    assert engine.stats().num_preemptions == 2
    engine.add_request([7] * 60, SamplingParams(max_tokens=4, ignore_eos=True), request_id="new")
    num_steps, first_token_step = 1, None
    while first_token_step is None:
        outputs = engine.step().outputs
        num_steps += 1
        if any(output.request_id == "new" and output.new_token_ids for output in outputs):
            first_token_step = num_steps
    assert predicted.ttft_s == first_token_step > 30


def test_a_retry_taken_in_part_before_younger_requests_is_forecast_as_planning_every_step_does():
    """A retry keeps its first attempt's place in line: taken in part, it goes before the younger running requests,
    and the scheduler gives it its next chunk before their decodes, which a tight budget may then leave out. Runs
    of decode steps hand that over to the scheduler; the forecast is the same either way."""
    engine = make_tiny_engine(kv_cache_memory=200 * 8192, swap_space=0, max_num_batched_tokens=512)
    for index in range(3):
        engine.add_request([1 + index] * 50, SamplingParams(max_tokens=60, ignore_eos=True), request_id=f"r{index}")
    engine.step()
    snapshot = engine.snapshot()
    oldest = min(work.place_in_line_ts for work in snapshot.running_work)
    retry = RemainingWork(1200, 0, 8, place_in_line_ts=oldest - 1.0)  # three chunks of a 512-token budget
    new = RemainingWork(40, 0, 20, math.inf)
    in_runs, step_by_step = (
        forecast(snapshot, engine.info, [], [retry], new, by_shape, horizon_s=1e9, fast_forward=on)
        for on in (True, False)
    )
    assert in_runs == step_by_step
    assert step_by_step.tpot_s is not None
