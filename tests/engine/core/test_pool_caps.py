"""A cap on a pool's capacity (the kv_cap and swap_cap faults): reclaimed by preemption, never by failing a request."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool
from engine.core.config import PreemptionMode
from engine.core.outputs import FinishReason
from engine.core.request import RequestStatus
from tests.engine.core.factories import fake_step, make_request, make_requests, make_scheduler, run_to_completion


def test_a_capped_pool_allocates_only_up_to_its_capacity_and_reports_what_is_over():
    pool = BlockPool(10)
    held = pool.allocate(6)
    pool.set_capacity(4)
    assert (pool.num_used_blocks, pool.num_free_blocks, pool.num_over_capacity) == (6, 0, 2)
    assert pool.allocate(1) is None
    pool.free(held[:3])
    assert (pool.num_free_blocks, pool.num_over_capacity) == (1, 0)
    pool.set_capacity(10)
    assert pool.num_free_blocks == 7
    pool.check_invariants([held[3:]])
    with pytest.raises(ValueError, match=r"capacity must be in \[0, 10\]"):
        pool.set_capacity(11)


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_a_cap_on_a_full_pool_is_reclaimed_by_preemption_in_the_next_step_and_nothing_is_lost(mode):
    scheduler = make_scheduler(num_blocks=20, num_host_blocks=40, max_num_batched_tokens=128, preemption_mode=mode)
    requests = make_requests(5, prompt_len=16, max_tokens=8)
    for request in requests:
        scheduler.add_request(request)
    fake_step(scheduler)
    assert scheduler.kv.device_pool.num_used_blocks == 20  # 5 prompts x 4 blocks: the pool is full
    scheduler.kv.device_pool.set_capacity(6)  # a 30% cap
    output, _ = fake_step(scheduler)
    assert scheduler.kv.device_pool.num_used_blocks <= 6
    assert {p.mode for p in output.preemptions} == {mode}
    newest_first = [r.request_id for r in reversed(requests)]
    assert [p.request_id for p in output.preemptions] == newest_first[: len(output.preemptions)]
    while scheduler.has_unfinished_requests():
        fake_step(scheduler)
        scheduler.check_invariants()
        assert scheduler.kv.device_pool.num_used_blocks <= 6
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 8 for r in requests)
    assert scheduler.kv.device_pool.num_used_blocks == scheduler.kv.host_pool.num_used_blocks == 0


def test_a_request_that_cannot_fit_under_the_cap_waits_for_it_to_lift_instead_of_churning():
    scheduler = make_scheduler(num_blocks=20, max_num_batched_tokens=64)
    scheduler.kv.device_pool.set_capacity(3)
    big, small = make_request(prompt_len=12, max_tokens=8), make_request(prompt_len=4, max_tokens=4)  # 5 and 2 blocks
    scheduler.add_request(big)
    scheduler.add_request(small)
    for _ in range(10):
        output, _ = fake_step(scheduler)
        assert big.request_id not in {s.request_id for s in output.scheduled}
        assert not output.preemptions
    assert big.status is RequestStatus.WAITING
    assert big.num_preemptions == 0
    scheduler.kv.device_pool.set_capacity(20)
    run_to_completion(scheduler)
    assert big.finish_reason is FinishReason.LENGTH


def test_a_capped_host_pool_turns_swaps_into_recomputes():
    scheduler = make_scheduler(num_blocks=6, num_host_blocks=16, preemption_mode=PreemptionMode.SWAP)
    scheduler.kv.host_pool.set_capacity(0)
    for request in make_requests(3, prompt_len=7, max_tokens=4):
        scheduler.add_request(request)
    preemptions = [p for output in run_to_completion(scheduler) for p in output.preemptions]
    assert preemptions
    assert {(p.mode, p.reason) for p in preemptions} == {(PreemptionMode.RECOMPUTE, "host_pool_full")}
