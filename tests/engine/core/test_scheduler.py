"""Scheduler and KV cache manager behaviour with tiny pools and a fake runner (no model, no torch)."""

from __future__ import annotations

import pytest

from engine.core.config import PreemptionMode
from engine.core.outputs import FinishReason
from engine.core.request import RequestStatus
from tests.engine.core.factories import (
    BLOCK_SIZE,
    fake_step,
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
)


def test_token_budget_and_max_num_seqs_hold_every_step():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=5, max_num_batched_tokens=24)
    for request in make_requests(12, prompt_len=30, max_tokens=6):
        scheduler.add_request(request)
    for output in run_to_completion(scheduler):
        assert output.num_batched_tokens <= 24
        assert len(output.scheduled) <= 5
        assert len(scheduler.running) <= 5


def test_long_prompt_is_chunked_and_samples_only_after_its_last_chunk():
    scheduler = make_scheduler(num_blocks=32, max_num_batched_tokens=16)
    request = make_request(prompt_len=50, max_tokens=2)
    scheduler.add_request(request)
    chunks = []
    for _ in range(4):
        output, _ = fake_step(scheduler)
        (scheduled,) = output.scheduled
        chunks.append((scheduled.num_computed_tokens, scheduled.num_new_tokens, scheduled.needs_sample))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert request.output_token_ids == [7]


def test_without_chunking_a_prompt_waits_for_a_step_with_room_for_all_of_it():
    scheduler = make_scheduler(num_blocks=32, max_num_batched_tokens=20, enable_chunked_prefill=False)
    first, second = make_request(prompt_len=12), make_request(prompt_len=12)
    scheduler.add_request(first)
    scheduler.add_request(second)
    output, _ = fake_step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [(first.request_id, 12)]
    output, _ = fake_step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [
        (first.request_id, 1),
        (second.request_id, 12),
    ]


def test_a_step_that_decodes_computes_at_most_the_prefill_cap_of_prompts_and_one_that_does_not_the_whole_budget():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_prefill_tokens_beside_decodes=8)
    alone = make_request(prompt_len=40, max_tokens=20)
    scheduler.add_request(alone)
    output, _ = fake_step(scheduler)
    assert [s.num_new_tokens for s in output.scheduled] == [32]  # no decode in the step: the whole budget
    fake_step(scheduler)  # the rest of its prompt, then it decodes
    late = make_request(prompt_len=20, max_tokens=2)
    scheduler.add_request(late)
    chunks = []
    while not late.output_token_ids:
        output, _ = fake_step(scheduler)
        first = output.scheduled[0]
        assert (first.request_id, first.num_new_tokens) == (alone.request_id, 1)
        chunks.extend(s.num_new_tokens for s in output.scheduled if s.request_id == late.request_id)
    assert chunks == [8, 8, 4]


def test_a_prompt_that_finds_no_prefill_tokens_left_waits_and_the_decodes_younger_than_it_still_run():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_prefill_tokens_beside_decodes=8)
    # As a snapshot shows them (how the forecast starts): two requests part way through their prompts, the older
    # first, and a younger one decoding.
    older, younger = make_request(prompt_len=24, max_tokens=2), make_request(prompt_len=24, max_tokens=2)
    decoding = make_request(prompt_len=4, max_tokens=2)
    for request, num_computed in ((older, 4), (younger, 4), (decoding, 3)):
        request.num_computed_tokens = num_computed
        scheduler.restore_request(request, RequestStatus.RUNNING, num_blocks=1)
    output, _ = fake_step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [
        (older.request_id, 8),
        (decoding.request_id, 1),
    ]
    scheduler.check_invariants()


def test_running_decodes_come_first_then_new_prompts_in_arrival_order():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=32)
    early = make_requests(3, prompt_len=8)
    for request in early:
        scheduler.add_request(request)
    fake_step(scheduler)  # all three prefill in one step
    late = make_requests(2, prompt_len=8)
    for request in late:
        scheduler.add_request(request)
    output, _ = fake_step(scheduler)
    assert [s.request_id for s in output.scheduled] == [r.request_id for r in early + late]
    assert [s.num_new_tokens for s in output.scheduled] == [1, 1, 1, 8, 8]


def test_a_retry_takes_its_place_in_line_from_its_first_attempt():
    """A request sent again after its Retry-After carries its first attempt's arrival: it is admitted ahead of
    the requests that arrived after that attempt, behind those that arrived before it."""
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=8)
    before, after = make_request(prompt_len=8), make_request(prompt_len=8)
    retry = make_request(prompt_len=8)
    retry.first_attempt_ts = (before.arrival_ts + after.arrival_ts) / 2
    assert before.arrival_ts < retry.first_attempt_ts < after.arrival_ts < retry.arrival_ts
    for request in (before, after, retry):
        scheduler.add_request(request)
    admitted = [fake_step(scheduler)[0].scheduled[-1].request_id for _ in range(3)]
    assert admitted == [before.request_id, retry.request_id, after.request_id]


def test_finished_request_leaves_in_its_step_and_its_place_is_refilled_next_step():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    short, long_, waiting = make_request(4, max_tokens=1), make_request(4, max_tokens=5), make_request(4)
    for request in (short, long_, waiting):
        scheduler.add_request(request)
    output, results = fake_step(scheduler)
    assert {s.request_id for s in output.scheduled} == {short.request_id, long_.request_id}
    assert [r.finish_reason for r in results if r is short] == [FinishReason.LENGTH]
    assert short.request_id not in scheduler.kv.device_tables
    output, _ = fake_step(scheduler)
    assert [s.request_id for s in output.scheduled] == [long_.request_id, waiting.request_id]


def test_preemption_picks_the_newest_running_request():
    # 6 blocks of 4 tokens; three requests of 7 prompt tokens take 2 blocks each and all need a third soon.
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    requests = make_requests(3, prompt_len=7, max_tokens=4)
    for request in requests:
        scheduler.add_request(request)
    fake_step(scheduler)  # prefill: 8 tokens -> 2 blocks each, pool full
    output, _ = fake_step(scheduler)  # first decode fits (token 8 of 8); the next does not
    output, _ = fake_step(scheduler)
    assert [p.request_id for p in output.preemptions] == [requests[2].request_id]
    assert requests[2].status is RequestStatus.WAITING
    assert requests[2].num_computed_tokens == 0
    assert [s.request_id for s in output.scheduled] == [r.request_id for r in requests[:2]]
    scheduler.check_invariants()


def test_swap_mode_moves_blocks_to_host_and_back_before_new_admissions():
    scheduler = make_scheduler(
        num_blocks=6, num_host_blocks=8, max_num_batched_tokens=64, preemption_mode=PreemptionMode.SWAP
    )
    requests = make_requests(3, prompt_len=7, max_tokens=6)
    for request in requests:
        scheduler.add_request(request)
    fake_step(scheduler)
    fake_step(scheduler)
    output, _ = fake_step(scheduler)
    victim = requests[2]
    (event,) = output.preemptions
    assert (event.request_id, event.mode, event.num_blocks) == (victim.request_id, PreemptionMode.SWAP, 2)
    assert len(output.blocks_to_swap_out) == 2
    assert victim.status is RequestStatus.SWAPPED
    assert scheduler.kv.num_swapped_blocks(victim.request_id) == 2
    newcomer = make_request(prompt_len=2)
    scheduler.add_request(newcomer)
    swapped_in_at = admitted_at = None
    for step in range(40):
        output, _ = fake_step(scheduler)
        scheduler.check_invariants()
        if output.blocks_to_swap_in and swapped_in_at is None:
            swapped_in_at = step
            assert victim.request_id in {s.request_id for s in output.scheduled}
        if newcomer.request_id in {s.request_id for s in output.scheduled} and admitted_at is None:
            admitted_at = step
    assert swapped_in_at is not None
    assert admitted_at is not None
    assert swapped_in_at <= admitted_at
    assert victim.num_computed_tokens == 0 or victim.is_finished


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    scheduler = make_scheduler(
        num_blocks=6, num_host_blocks=1, max_num_batched_tokens=64, preemption_mode=PreemptionMode.SWAP
    )
    for request in make_requests(3, prompt_len=7, max_tokens=4):
        scheduler.add_request(request)
    preemptions = [p for output in run_to_completion(scheduler) for p in output.preemptions]
    assert preemptions
    assert {(p.mode, p.reason) for p in preemptions} == {(PreemptionMode.RECOMPUTE, "host_pool_full")}


def test_watermark_holds_back_admissions_but_not_running_growth():
    scheduler = make_scheduler(num_blocks=10, watermark=0.3, max_num_batched_tokens=64)  # 3 blocks reserved
    first, second = make_request(prompt_len=16), make_request(prompt_len=16)
    scheduler.add_request(first)
    scheduler.add_request(second)
    output, _ = fake_step(scheduler)
    # The first takes 4 blocks (6 free stay above 3); the second would leave 2 < 3 free.
    assert [s.request_id for s in output.scheduled] == [first.request_id]
    assert scheduler.kv.device_pool.num_free_blocks == 6


def test_abort_frees_blocks_immediately_in_every_state():
    scheduler = make_scheduler(
        num_blocks=6, num_host_blocks=8, max_num_batched_tokens=64, preemption_mode=PreemptionMode.SWAP
    )
    requests = make_requests(3, prompt_len=7, max_tokens=6)
    waiting = make_request(prompt_len=3)
    for request in [*requests, waiting]:
        scheduler.add_request(request)
    for _ in range(3):
        fake_step(scheduler)
    assert requests[2].status is RequestStatus.SWAPPED
    for request in [requests[2], waiting, requests[0]]:  # swapped, waiting, running
        held = len(scheduler.kv.block_ids(request.request_id)) + scheduler.kv.num_swapped_blocks(request.request_id)
        free_before = scheduler.kv.device_pool.num_free_blocks + scheduler.kv.host_pool.num_free_blocks
        assert scheduler.abort_request(request.request_id)
        assert request.finish_reason is FinishReason.ABORT
        assert scheduler.kv.device_pool.num_free_blocks + scheduler.kv.host_pool.num_free_blocks == free_before + held
        scheduler.check_invariants()
    assert not scheduler.abort_request(requests[0].request_id)


def test_kv_waste_is_under_one_block_per_running_request_when_the_pool_is_full():
    scheduler = make_scheduler(num_blocks=40, max_num_seqs=16, max_num_batched_tokens=64)
    for request in make_requests(16, prompt_len=9, max_tokens=40):
        scheduler.add_request(request)
    full_steps = 0
    for _ in range(60):
        fake_step(scheduler)
        if scheduler.kv.device_pool.num_free_blocks == 0:
            full_steps += 1
        for request in scheduler.running:
            slots = len(scheduler.kv.block_ids(request.request_id)) * BLOCK_SIZE
            assert 0 <= slots - request.num_computed_tokens < BLOCK_SIZE
    assert full_steps > 0, "the pool must actually fill up for this test to mean anything"


def test_min_tokens_bans_stop_tokens_until_reached():
    scheduler = make_scheduler(num_blocks=16)
    request = make_request(prompt_len=4, max_tokens=8, stop_token_ids=(7,), min_tokens=3)
    scheduler.add_request(request)
    banned = []
    while scheduler.has_unfinished_requests():
        output, _ = fake_step(scheduler)
        banned.append(output.scheduled[0].banned_token_ids)
    # The fake runner always returns 7: it ends the request at the first step it is allowed.
    assert request.output_token_ids == [7, 7, 7, 7]
    assert banned == [frozenset({7})] * 3 + [frozenset()]
    assert request.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_everything_finishes_and_every_block_returns_under_heavy_pressure(mode):
    scheduler = make_scheduler(num_blocks=12, num_host_blocks=6, max_num_seqs=6, preemption_mode=mode)
    requests = make_requests(20, prompt_len=11, max_tokens=14)
    for request in requests:
        scheduler.add_request(request)
    steps = run_to_completion(scheduler)
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 14 for r in requests)
    assert sum(len(s.preemptions) for s in steps) > 0
    assert scheduler.kv.device_pool.num_free_blocks == 12
    assert scheduler.kv.host_pool.num_free_blocks == 6


def test_no_new_admission_while_a_swapped_request_waits_even_if_the_newcomer_would_fit():
    scheduler = make_scheduler(
        num_blocks=6, num_host_blocks=8, max_num_batched_tokens=64, preemption_mode=PreemptionMode.SWAP
    )
    big, victim = make_request(prompt_len=16, max_tokens=8), make_request(prompt_len=7, max_tokens=8)
    scheduler.add_request(big)
    scheduler.add_request(victim)
    fake_step(scheduler)  # big: 4 blocks, victim: 2 blocks; the pool is full
    output, _ = fake_step(scheduler)  # big needs a 5th block: the victim is swapped out
    assert victim.status is RequestStatus.SWAPPED
    assert scheduler.kv.device_pool.num_free_blocks == 1
    newcomer = make_request(prompt_len=2, max_tokens=1)  # would fit in the one free block
    scheduler.add_request(newcomer)
    for _ in range(30):
        output, _ = fake_step(scheduler)
        if victim.status is RequestStatus.SWAPPED:
            assert newcomer.request_id not in {s.request_id for s in output.scheduled}
    assert newcomer.is_finished
    assert victim.is_finished


def test_phase_follows_a_request_through_queue_chunks_decode_and_swap():
    scheduler = make_scheduler(
        num_blocks=8, num_host_blocks=8, max_num_batched_tokens=8, preemption_mode=PreemptionMode.SWAP
    )
    long_prompt, waiting = make_request(prompt_len=12, max_tokens=8), make_request(prompt_len=12, max_tokens=8)
    scheduler.add_request(long_prompt)
    scheduler.add_request(waiting)
    assert (long_prompt.phase, waiting.phase) == ("queued", "queued")
    fake_step(scheduler)  # 8 of 12 prompt tokens
    assert (long_prompt.phase, waiting.phase) == ("prefill", "queued")
    fake_step(scheduler)  # the last 4 and the first token; the other request starts its prompt
    assert (long_prompt.phase, waiting.phase) == ("decode", "prefill")
    # Each needs 5 of the 8 blocks by the end: the newer one is swapped out on the way.
    while not scheduler.swapped:
        fake_step(scheduler)
    assert (long_prompt.phase, waiting.phase) == ("decode", "swapped")
    run_to_completion(scheduler)
    assert (long_prompt.phase, waiting.phase) == ("finished", "finished")
