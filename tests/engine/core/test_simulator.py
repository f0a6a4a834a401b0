"""The simulator runs the engine's own scheduler in virtual time: its clock adds up exactly what the step-cost model
says, every request ends in the outcome its client would see, the faults act on the timeline and are cleared, and
the pools and queues keep every invariant after each step."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random

import pytest

from engine.core.admission import AdmissionLimits
from engine.core.config import PreemptionMode, SchedulerConfig
from engine.core.simulator import (
    FaultWindow,
    Outcome,
    SimulatedArrival,
    SimulatedEngine,
    SimulatedSession,
    SimulatedTurn,
    Simulation,
)
from engine.core.step_cost import LinearStepCost, StepShape
from loadgen.client import retry_wait_s

COST = LinearStepCost(
    per_step_s=0.010,
    per_prefill_token_s=0.001,
    per_decode_s=0.002,
    per_context_token_s=1e-5,
    per_attended_pair_s=1e-7,
    swap_block_s=0.0005,
)


def engine(num_device_blocks: int = 1000, mode: PreemptionMode = PreemptionMode.AUTO, **config) -> SimulatedEngine:
    return SimulatedEngine(
        num_device_blocks=num_device_blocks,
        num_host_blocks=400,
        block_size=16,
        bytes_per_block=16 * 1024,
        max_model_len=4096,
        scheduler_config=SchedulerConfig(preemption_mode=mode, **config),
        cost=COST,
    )


def poisson(count: int, rate: float, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for index in range(count):
        t += rng.expovariate(rate)
        arrivals.append(SimulatedArrival(index, t, rng.randint(*prompt), rng.randint(*output)))
    return arrivals


def outcomes(result) -> dict[str, int]:
    counts = dict.fromkeys((Outcome.OK, Outcome.REJECTED, Outcome.BROKEN_STREAM, Outcome.CLIENT_TIMEOUT), 0)
    for request in result.requests:
        counts[request.outcome] += 1
    return counts


def test_one_request_alone_takes_exactly_the_steps_the_cost_model_prices():
    arrival = SimulatedArrival(0, 2.5, num_prompt_tokens=100, max_tokens=4)
    simulation = Simulation(dataclasses.replace(engine(), token_latency_s=0.004), [arrival])
    result = simulation.run()
    (request,) = result.requests
    prefill = COST.step_s(StepShape.of_batch([(0, 100)]))
    # Each decode computes the token sampled before it, at a context one longer each time.
    decodes = [COST.step_s(StepShape.of_batch([(100 + k, 1)])) for k in range(3)]
    expected = list(itertools.accumulate([2.5 + prefill, *decodes]))
    assert request.outcome == Outcome.OK
    # Each token reaches the client the token latency after its step.
    assert request.token_times_s == pytest.approx([t + 0.004 for t in expected], abs=1e-12)
    assert result.end_s == pytest.approx(expected[-1])


def test_a_busy_run_keeps_every_invariant_and_every_request_gets_all_its_tokens_in_order():
    arrivals = poisson(300, rate=20, prompt=(16, 600), output=(1, 200), seed=1)
    simulation = Simulation(engine(num_device_blocks=160), arrivals, check_invariants=True)
    result = simulation.run()
    assert outcomes(result)[Outcome.OK] == 300
    for request in result.requests:
        times = request.token_times_s
        assert len(times) == request.arrival.max_tokens
        assert times[0] > request.arrival.at_s
        assert all(a < b for a, b in itertools.pairwise(times))
    assert sum(result.preemptions.values()) > 0, "a pool of 160 blocks under this load must preempt"
    assert result.num_swapped_out_blocks == result.num_swapped_in_blocks
    kv = simulation.scheduler.kv
    assert kv.device_pool.num_used_blocks == kv.host_pool.num_used_blocks == 0


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_the_preemption_mode_is_the_engines_own_policy(mode):
    arrivals = poisson(120, rate=30, prompt=(64, 400), output=(50, 200), seed=2)
    simulation = Simulation(engine(num_device_blocks=120, mode=mode), arrivals, check_invariants=True)
    result = simulation.run()
    assert outcomes(result)[Outcome.OK] == 120
    other = PreemptionMode.RECOMPUTE if mode is PreemptionMode.SWAP else PreemptionMode.SWAP
    assert result.preemptions[mode.value] > 0
    assert result.preemptions[other.value] == 0
    assert simulation.scheduler.kv.device_pool.num_used_blocks == 0


def preemption_times(result) -> list[float]:
    steps = itertools.pairwise(result.steps)
    return [step.end_s for prev, step in steps if step.num_preemptions != prev.num_preemptions]


def test_a_kv_cap_preempts_during_its_window_and_is_lifted_after_it():
    arrivals = poisson(60, rate=1.5, prompt=(64, 300), output=(30, 100), seed=3)
    uncapped = Simulation(engine(num_device_blocks=400), arrivals).run()
    assert preemption_times(uncapped) == [], "the whole pool holds this load"
    window = FaultWindow("kv_cap", 5.0, 12.0, {"kv_cap": {"fraction": 0.1}})
    simulation = Simulation(engine(num_device_blocks=400), arrivals, [window], check_invariants=True)
    result = simulation.run()
    assert outcomes(result)[Outcome.OK] == 60
    preempted_at = preemption_times(result)
    assert preempted_at, "a cap to 10% of the pool under this load must preempt"
    assert all(5.0 <= t <= 12.0 for t in preempted_at), preempted_at
    assert simulation.scheduler.kv.device_pool.capacity == 400


def test_out_of_memory_steps_back_off_and_lose_no_request():
    arrivals = poisson(60, rate=20, prompt=(100, 300), output=(10, 40), seed=4)
    faults = [
        FaultWindow("fail_next_steps", 1.0, 2.0, {"fail_next_steps": 3}),
        FaultWindow("oom_above_batched_tokens", 2.0, 6.0, {"oom_above_batched_tokens": 64}),
    ]
    result = Simulation(engine(), arrivals, faults, check_invariants=True).run()
    assert outcomes(result)[Outcome.OK] == 60
    assert result.num_failed_steps >= 3


def test_a_kill_breaks_the_streams_in_the_engine_refuses_arrivals_while_down_and_restarts_empty():
    arrivals = [SimulatedArrival(i, 0.5 * i, 64, 400) for i in range(20)]
    window = FaultWindow("kill", 3.2, 5.1, None)
    result = Simulation(engine(), arrivals, [window], check_invariants=True).run()
    by_outcome = {r.arrival.index: r.outcome for r in result.requests}
    # Requests 0-6 arrived before the kill and were still streaming (400 tokens take longer than 3 s).
    assert all(by_outcome[i] == Outcome.BROKEN_STREAM for i in range(7))
    assert all(by_outcome[i] == Outcome.REJECTED for i in (7, 8, 9, 10))  # arrived at 3.5-5.0 s: down
    assert all(by_outcome[i] == Outcome.OK for i in range(11, 20))
    broken = result.requests[0]
    assert broken.token_times_s
    assert broken.token_times_s[-1] <= 3.2 + 1.0


def test_a_client_that_waits_past_its_timeout_gives_up_and_frees_its_blocks():
    # One request needs the whole pool for ever (as far as the timeout goes): the others wait behind it.
    arrivals = [SimulatedArrival(0, 0.0, 64, 3000), *(SimulatedArrival(i, 0.1, 64, 10) for i in range(1, 4))]
    result = Simulation(engine(num_device_blocks=200), arrivals, request_timeout_s=5.0, check_invariants=True).run()
    assert result.requests[0].outcome == Outcome.CLIENT_TIMEOUT
    assert all(r.outcome == Outcome.OK for r in result.requests[1:])


def test_the_run_ends_with_its_last_request_not_with_a_fault_after_it():
    arrivals = [SimulatedArrival(0, 0.0, 64, 8)]
    result = Simulation(engine(), arrivals, [FaultWindow("kill", 50.0, 60.0, None)]).run()
    assert result.end_s == pytest.approx(result.requests[0].token_times_s[-1])


def test_a_request_that_can_never_fit_is_refused_before_it_starts():
    result = Simulation(engine(num_device_blocks=10), [SimulatedArrival(0, 0.0, 200, 10)]).run()
    assert result.requests[0].outcome == Outcome.REJECTED
    assert "KV blocks" in result.requests[0].error


def ttft_s(request) -> float:
    return request.token_times_s[0] - request.arrival.at_s


def test_admission_with_a_ttft_objective_sheds_an_overload_and_the_admitted_meet_it():
    arrivals = poisson(200, rate=2, prompt=(100, 600), output=(50, 200), seed=3)  # about 2.5x the engine's capacity
    unguarded = Simulation(engine(num_device_blocks=300), arrivals).run()
    assert outcomes(unguarded)[Outcome.REJECTED] == 0
    assert max(ttft_s(r) for r in unguarded.requests) > 60.0, "the load must overload the engine"
    simulation = Simulation(
        engine(num_device_blocks=300), arrivals, admission=AdmissionLimits(ttft_slo_s=2.0), check_invariants=True
    )
    result = simulation.run()
    counts = outcomes(result)
    assert counts[Outcome.REJECTED] > 50, counts
    assert counts[Outcome.OK] > 50, counts
    assert counts[Outcome.OK] + counts[Outcome.REJECTED] == 200
    refused = [r for r in result.requests if r.outcome == Outcome.REJECTED]
    assert all(r.error.startswith("429: server busy:") and not r.token_times_s for r in refused)
    admitted = sorted(ttft_s(r) for r in result.requests if r.outcome == Outcome.OK)
    assert admitted[int(0.99 * len(admitted))] <= 2.0
    # The controller learnt from what the simulated engine did: every step, and first tokens (its corrections).
    assert simulation.admission.model.num_observations == result.num_steps
    assert simulation.admission.corrections() != (1.0, 1.25)


def test_admission_counts_the_requests_that_arrive_at_one_instant():
    arrivals = [SimulatedArrival(i, 1.0, 64, 8) for i in range(6)]
    result = Simulation(engine(), arrivals, admission=AdmissionLimits(max_waiting=3)).run()
    assert [r.outcome for r in result.requests] == [Outcome.OK] * 3 + [Outcome.REJECTED] * 3
    assert "3 requests are waiting (limit 3)" in result.requests[3].error


def test_a_request_arriving_during_a_step_is_decided_on_what_the_engine_published_before_it():
    # A's prefill runs from 0 s to 0.11 s. B arrives during it: the engine published its state before A was taken
    # in, and A counts as taken in by the step in progress (waiting, to the forecast). C arrives during A's first
    # decode: the published state has A running, nothing waiting.
    arrivals = [SimulatedArrival(0, 0.0, 100, 50), SimulatedArrival(1, 0.05, 16, 4), SimulatedArrival(2, 0.2, 16, 4)]
    result = Simulation(engine(), arrivals, admission=AdmissionLimits(max_waiting=1), fast_forward=False).run()
    assert [r.outcome for r in result.requests] == [Outcome.OK, Outcome.REJECTED, Outcome.OK]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv_cap": {"fraction": 2}}, "fraction"),
        ({"no_such_fault": 1}, "unknown fault"),
        ({"step_delay": -1}, "step_delay"),
        ({"memory_hog": 1000}, "not simulated"),
    ],
)
def test_a_bad_fault_value_is_refused_when_the_timeline_is_built(changes, message):
    with pytest.raises(ValueError, match=message):
        FaultWindow("bad", 1.0, 2.0, changes)
    with pytest.raises(ValueError, match="start < end"):
        FaultWindow("backwards", 2.0, 1.0, None)


@pytest.mark.parametrize(
    ("num_blocks", "mode", "faults", "config", "admission"),
    [
        (2000, PreemptionMode.AUTO, [], {}, None),
        (150, PreemptionMode.AUTO, [], {}, None),
        # Recomputed requests find the blocks of their own outputs cached: when a run registers them matters.
        (150, PreemptionMode.RECOMPUTE, [], {}, None),
        (400, PreemptionMode.SWAP, [FaultWindow("kv_cap", 3.0, 9.0, {"kv_cap": {"fraction": 0.3}})], {}, None),
        (
            1000,
            PreemptionMode.AUTO,
            [FaultWindow("step_delay", 2.0, 4.0, {"step_delay": 0.05}), FaultWindow("kill", 6.0, 7.0, None)],
            {},
            None,
        ),
        # Prompts longer than a step's budget: a run carries the newest request through its prompt in chunks, also
        # one recomputed after a preemption.
        (1000, PreemptionMode.AUTO, [], {"max_num_batched_tokens": 160}, None),
        (150, PreemptionMode.RECOMPUTE, [], {"max_num_batched_tokens": 160}, None),
        # Out-of-memory steps above 300 tokens for a while: a run plans no prefill during it.
        (1000, PreemptionMode.AUTO, [FaultWindow("oom", 2.0, 5.0, {"oom_above_batched_tokens": 300})], {}, None),
        # Admission decides each arrival on what the engine published: a run ends at every arrival.
        (300, PreemptionMode.AUTO, [], {}, AdmissionLimits(ttft_slo_s=1.0)),
    ],
)
def test_runs_of_decode_steps_in_one_go_decide_and_time_exactly_as_step_by_step(
    num_blocks, mode, faults, config, admission
):
    arrivals = poisson(150, rate=12, prompt=(16, 400), output=(1, 300), seed=5)
    runs = [
        Simulation(
            engine(num_blocks, mode, **config),
            arrivals,
            faults,
            check_invariants=True,
            fast_forward=on,
            admission=admission,
        ).run()
        for on in (False, True)
    ]
    step_by_step, fast = runs
    assert fast.num_steps == step_by_step.num_steps
    assert fast.preemptions == step_by_step.preemptions
    assert fast.num_swapped_out_blocks == step_by_step.num_swapped_out_blocks
    assert fast.end_s == pytest.approx(step_by_step.end_s, rel=1e-9)
    for slow_request, fast_request in zip(step_by_step.requests, fast.requests, strict=True):
        assert fast_request.outcome == slow_request.outcome
        assert fast_request.num_cached_tokens == slow_request.num_cached_tokens
        assert fast_request.token_times_s == pytest.approx(slow_request.token_times_s, rel=1e-9, abs=1e-9)
    assert len(fast.steps) < len(step_by_step.steps), "some decode runs went in one go"


def conversations(count: int, turns: int, think_s: float = 0.5, shared: int = 40, seed: int = 3):
    rng = random.Random(seed)
    return [
        SimulatedSession(
            index,
            index * 0.7,
            tuple(
                SimulatedTurn(rng.randint(20, 90) + (shared if turn == 0 else 0), rng.randint(5, 40))
                for turn in range(turns)
            ),
            think_s,
            shared,
        )
        for index in range(count)
    ]


def test_a_sessions_next_turn_sends_the_conversation_after_the_answer_and_finds_it_cached():
    sessions = conversations(6, turns=3)
    result = Simulation(engine(), sessions=sessions, check_invariants=True).run()
    assert outcomes(result)[Outcome.OK] == len(result.requests) == 6 * 3
    by_index = {request.arrival.index: request for request in result.requests}
    for session in sessions:
        first = by_index[session.index * 3]
        assert first.arrival.at_s == session.at_s
        assert first.arrival.num_prompt_tokens == session.turns[0].num_new_tokens
        for turn in (1, 2):
            previous, request = by_index[session.index * 3 + turn - 1], by_index[session.index * 3 + turn]
            assert request.arrival.at_s == pytest.approx(previous.token_times_s[-1] + session.think_s)
            conversation = previous.arrival.num_prompt_tokens + previous.arrival.max_tokens
            assert request.arrival.num_prompt_tokens == conversation + session.turns[turn].num_new_tokens
            # Every block of the conversation whose KV was computed (all but its last token's) is found cached.
            assert request.num_cached_tokens == (conversation - 1) // 16 * 16
    # The system prompt every session shares is cached for all but the first: its full blocks, and no more.
    later_firsts = [by_index[session.index * 3] for session in sessions[1:]]
    assert {request.num_cached_tokens for request in later_firsts} == {40 // 16 * 16}


def test_a_turn_that_does_not_end_ok_ends_its_session():
    sessions = conversations(4, turns=4, think_s=0.0)
    result = Simulation(engine(), sessions=sessions, faults=[FaultWindow("kill", 1.5, 1.6, None)]).run()
    broken = [r for r in result.requests if r.outcome != Outcome.OK]
    assert broken, "the kill breaks a turn in flight"
    for request in broken:
        session = request.arrival.session
        later = [r for r in result.requests if r.arrival.session is session and r.arrival.index > request.arrival.index]
        assert later == [], "no turn after one that did not end ok is sent"


def test_sessions_in_runs_of_decode_steps_decide_and_time_exactly_as_step_by_step():
    sessions = conversations(30, turns=4, think_s=0.2)
    runs = [Simulation(engine(300), sessions=sessions, fast_forward=on).run() for on in (False, True)]
    step_by_step, fast = runs
    assert fast.num_steps == step_by_step.num_steps
    assert fast.preemptions == step_by_step.preemptions
    assert [r.arrival.at_s for r in fast.requests] == pytest.approx([r.arrival.at_s for r in step_by_step.requests])
    for slow_request, fast_request in zip(step_by_step.requests, fast.requests, strict=True):
        assert fast_request.token_times_s == pytest.approx(slow_request.token_times_s, rel=1e-9, abs=1e-9)
        assert fast_request.num_cached_tokens == slow_request.num_cached_tokens


def clients_retrying(retries: int):
    return functools.partial(retry_wait_s, retries)


def test_a_client_that_retries_a_429_comes_back_after_its_retry_after_with_its_times_from_the_first_send():
    arrivals = [SimulatedArrival(index, 1.0 + index * 0.005, 64, 8) for index in range(6)]
    limits = AdmissionLimits(max_waiting=1)  # one runs, one waits, the rest are refused
    once = Simulation(engine(max_num_seqs=1), arrivals, admission=limits).run()
    assert outcomes(once)[Outcome.REJECTED] >= 3
    again = Simulation(engine(max_num_seqs=1), arrivals, admission=limits, retry_wait_s=clients_retrying(5)).run()
    assert outcomes(again)[Outcome.OK] == len(again.requests) == 6
    came_back = [request for request in again.requests if request.attempts > 1]
    assert len(came_back) >= 3
    for request in came_back:
        assert request.sent_at_s >= request.arrival.at_s + 1.0 * (request.attempts - 1)
        assert request.token_times_s[0] > request.sent_at_s  # its TTFT, from the first send, holds every wait


def test_a_retry_that_comes_back_when_told_keeps_its_place_in_line_and_the_whole_objective():
    arrivals = [SimulatedArrival(index, 1.0 + index * 0.01, 300, 16) for index in range(30)]
    limits = AdmissionLimits(ttft_slo_s=1.0)
    result = Simulation(engine(), arrivals, admission=limits, retry_wait_s=clients_retrying(3)).run()
    honoured = [
        request
        for request in result.requests
        if request.outcome == Outcome.OK and request.attempts > 1 and request.place_in_line_ts == request.arrival.at_s
    ]
    assert honoured, "a retry admitted on the promise of its Retry-After takes its first send's place in line"
    assert all(request.sent_at_s > request.arrival.at_s for request in honoured)
