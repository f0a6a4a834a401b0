"""Thousands of random add / abort / step / cap operations: the block invariants hold after each, a pool never holds
more than its capacity for longer than one step, nothing leaks."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.config import PreemptionMode
from tests.engine.core.factories import BLOCK_SIZE, fake_step, make_request, make_scheduler, run_to_completion

NUM_BLOCKS = 16
NUM_HOST_BLOCKS = 8

operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
        st.tuples(st.just("cap"), st.integers(0, NUM_BLOCKS), st.integers(0, NUM_HOST_BLOCKS)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    mode=st.sampled_from(list(PreemptionMode)),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    watermark=st.sampled_from([0.0, 0.1, 0.25]),
)
def test_random_operations_never_break_block_invariants_or_leak(ops, mode, budget, max_num_seqs, watermark):
    scheduler = make_scheduler(
        num_blocks=NUM_BLOCKS,
        num_host_blocks=NUM_HOST_BLOCKS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        watermark=watermark,
    )
    added = []
    for op, a, b in ops:
        if op == "add":
            # The engine rejects what can never fit; the scheduler only sees requests that can.
            if -(-(a + b) // BLOCK_SIZE) <= NUM_BLOCKS:
                request = make_request(prompt_len=a, max_tokens=b)
                scheduler.add_request(request)
                added.append(request)
        elif op == "abort" and added:
            scheduler.abort_request(added[a % len(added)].request_id)
        elif op == "cap":
            scheduler.kv.device_pool.set_capacity(a)
            scheduler.kv.host_pool.set_capacity(b)
        else:
            output, _ = fake_step(scheduler)
            assert output.num_batched_tokens <= budget
            assert scheduler.kv.device_pool.num_over_capacity == 0
        scheduler.check_invariants()
    scheduler.kv.device_pool.set_capacity(NUM_BLOCKS)  # the cap lifts: everything that waited for it runs
    scheduler.kv.host_pool.set_capacity(NUM_HOST_BLOCKS)
    run_to_completion(scheduler)
    assert all(r.is_finished for r in added)
    assert scheduler.kv.device_pool.num_free_blocks == NUM_BLOCKS
    assert scheduler.kv.host_pool.num_free_blocks == NUM_HOST_BLOCKS
    assert not scheduler.kv.device_tables
    assert not scheduler.kv.host_tables
