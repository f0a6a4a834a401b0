"""The back-off after failed steps: halve on failure, double back after a run of successes, give up on a request
only when it fails alone in the smallest step."""

from __future__ import annotations

from engine.core.step_back_off import BatchLimit, StepBackOff


def test_a_failure_halves_the_batch_and_successes_double_it_back():
    back_off = StepBackOff(64, 2048, successes_to_grow=2)
    assert not back_off.on_failure(num_seqs=40, num_batched_tokens=1000)
    assert back_off.limit == BatchLimit(20, 500)
    assert not back_off.on_failure(num_seqs=20, num_batched_tokens=500)
    assert back_off.limit == BatchLimit(10, 250)
    back_off.on_success()
    assert back_off.limit == BatchLimit(10, 250)  # one success is not yet a run
    back_off.on_success()
    assert back_off.limit == BatchLimit(20, 500)
    for _ in range(6):
        back_off.on_success()
    assert back_off.limit == BatchLimit(64, 2048)
    assert not back_off.is_backing_off
    assert back_off.num_failures == 2


def test_a_failure_never_raises_the_limit_and_never_goes_below_one_request_and_the_minimum_tokens():
    back_off = StepBackOff(8, 512, min_num_batched_tokens=4)
    back_off.on_failure(num_seqs=8, num_batched_tokens=100)
    assert back_off.limit == BatchLimit(4, 50)
    back_off.on_failure(num_seqs=8, num_batched_tokens=400)  # a step bigger than the limit cannot happen, but
    assert back_off.limit == BatchLimit(4, 50)  # the limit only ever shrinks on failure
    for _ in range(10):
        back_off.on_failure(num_seqs=1, num_batched_tokens=1)
    assert back_off.limit == BatchLimit(1, 4)


def test_it_gives_up_on_a_request_after_three_failures_alone_in_the_smallest_step():
    back_off = StepBackOff(8, 512)
    assert not back_off.on_failure(num_seqs=1, num_batched_tokens=16)  # alone, but the step can still shrink
    assert not back_off.on_failure(num_seqs=1, num_batched_tokens=1)
    assert not back_off.on_failure(num_seqs=1, num_batched_tokens=1)
    back_off.on_success()  # a success in between: the request was not the cause
    assert not back_off.on_failure(num_seqs=1, num_batched_tokens=1)
    assert not back_off.on_failure(num_seqs=1, num_batched_tokens=1)
    assert back_off.on_failure(num_seqs=1, num_batched_tokens=1)
    assert not back_off.on_failure(num_seqs=1, num_batched_tokens=1)  # the count starts again for the next one


def test_without_chunked_prefill_only_the_number_of_requests_shrinks():
    back_off = StepBackOff(8, 512, min_num_batched_tokens=512)
    back_off.on_failure(num_seqs=8, num_batched_tokens=300)
    assert back_off.limit == BatchLimit(4, 512)
