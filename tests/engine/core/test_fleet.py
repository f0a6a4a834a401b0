"""A fleet of simulated engines behind a router: one replica is the plain simulation, the routers place requests as
they say, and a fault hits only the replicas it names."""

from __future__ import annotations

import dataclasses
import gc
import random

import pytest

from engine.core.admission import AdmissionLimits
from engine.core.block_hash import extend_block_hashes
from engine.core.fleet import Fleet
from engine.core.simulator import FaultWindow, Outcome, SimulatedArrival, Simulation
from tests.engine.core.test_simulator import clients_retrying, conversations, engine, poisson


def test_a_fleet_of_one_is_the_plain_simulation():
    arrivals = poisson(120, rate=10, prompt=(16, 400), output=(1, 200), seed=7)
    faults = [FaultWindow("kv_cap", 2.0, 6.0, {"kv_cap": {"fraction": 0.3}}), FaultWindow("kill", 8.0, 8.5, None)]
    alone = Simulation(engine(300), arrivals, faults).run()
    fleet = Fleet(engine(300), 1, "least-outstanding", [(window, [0]) for window in faults])
    requests = fleet.run(arrivals)
    assert [r.outcome for r in requests] == [r.outcome for r in alone.requests]
    assert [r.token_times_s for r in requests] == [r.token_times_s for r in alone.requests]
    assert fleet.merged(requests).preemptions == alone.preemptions


def test_every_replica_admits_on_its_own():
    arrivals = [SimulatedArrival(i, 1.0, 64, 8) for i in range(6)]
    fleet = Fleet(engine(), 2, "round-robin", admission=AdmissionLimits(max_waiting=2))
    requests = fleet.run(arrivals)
    # Replica 0 takes 0, 2, 4 and replica 1 takes 1, 3, 5: the third each one is sent finds two waiting.
    assert [r.outcome for r in requests] == [Outcome.OK] * 4 + [Outcome.REJECTED] * 2


def test_round_robin_takes_turns_and_least_outstanding_evens_the_load():
    arrivals = poisson(200, rate=40, prompt=(16, 200), output=(20, 200), seed=8)
    round_robin = Fleet(engine(), 4, "round-robin")
    round_robin.run(arrivals)
    assert [round_robin.assignment[a.index] for a in arrivals] == [i % 4 for i in range(200)]
    least = Fleet(engine(), 4, "least-outstanding")
    requests = least.run(arrivals)
    assert all(r.outcome == Outcome.OK for r in requests)
    counts = [list(least.assignment.values()).count(replica) for replica in range(4)]
    assert max(counts) - min(counts) <= 0.2 * 50, counts


def test_a_kv_cap_on_some_replicas_preempts_there_only_and_costs_the_fleet_its_tail():
    arrivals = poisson(400, rate=24, prompt=(64, 300), output=(30, 120), seed=9)
    cap = FaultWindow("kv_cap", 3.0, 12.0, {"kv_cap": {"fraction": 0.15}})
    calm = Fleet(engine(300), 8, "round-robin")
    calm_requests = calm.run(arrivals)
    capped = Fleet(engine(300), 8, "round-robin", [(cap, [0, 1])])
    capped_requests = capped.run(arrivals)
    preempted = [sum(replica.result.preemptions.values()) for replica in capped.replicas]
    assert preempted[0] > 0
    assert preempted[1] > 0
    assert preempted[2:] == [sum(replica.result.preemptions.values()) for replica in calm.replicas][2:]

    def ttft_p99(requests) -> float:
        ttfts = sorted(r.token_times_s[0] - r.arrival.at_s for r in requests if r.outcome == Outcome.OK)
        return ttfts[int(0.99 * (len(ttfts) - 1))]

    assert ttft_p99(capped_requests) > ttft_p99(calm_requests)


def test_prefix_affinity_sends_a_shared_prefix_to_one_replica_and_its_cache_serves_it():
    rng = random.Random(10)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(256)] for _ in range(4)]
    arrivals = []
    for index in range(160):
        prompt = prefixes[index % 4] + [rng.randrange(1000, 30000) for _ in range(64)]
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt, 16)
        arrivals.append(SimulatedArrival(index, index * 0.1, len(prompt), 32, tuple(hashes)))

    def cached_share(router: str) -> float:
        requests = Fleet(engine(), 4, router).run(arrivals)
        return sum(r.num_cached_tokens or 0 for r in requests) / sum(r.arrival.num_prompt_tokens for r in requests)

    affinity = Fleet(engine(), 4, "prefix-affinity")
    affinity.run(arrivals)
    for prefix in range(4):
        assert len({affinity.assignment[i] for i in range(prefix, 160, 4)}) == 1
    assert cached_share("prefix-affinity") > cached_share("least-outstanding")


@pytest.mark.parametrize(
    ("replicas", "router", "faults", "message"),
    [
        (0, "round-robin", [], "at least one replica"),
        (2, "random", [], "unknown router"),
        (2, "round-robin", [(FaultWindow("kill", 1.0, 2.0, None), [2])], "not among 0-1"),
    ],
)
def test_a_fleet_that_cannot_be_built_says_why(replicas, router, faults, message):
    with pytest.raises(ValueError, match=message):
        Fleet(engine(), replicas, router, faults)


def test_a_fleet_of_one_runs_sessions_as_the_plain_simulation():
    sessions = conversations(12, turns=3, think_s=0.3)
    alone = Simulation(engine(300), sessions=sessions).run()
    fleet = Fleet(engine(300), 1, "round-robin")
    requests = fleet.run([], sessions)
    assert [r.arrival.at_s for r in requests] == pytest.approx([r.arrival.at_s for r in alone.requests])
    for fleet_request, alone_request in zip(requests, alone.requests, strict=True):
        assert fleet_request.token_times_s == pytest.approx(alone_request.token_times_s, rel=1e-9, abs=1e-9)
        assert fleet_request.num_cached_tokens == alone_request.num_cached_tokens


@pytest.mark.parametrize("think_s", [0.0, 0.4])
def test_a_fleet_sends_each_turn_after_its_answer_whichever_replica_answered(think_s):
    sessions = conversations(20, turns=3, think_s=think_s)
    fleet = Fleet(engine(), 4, "least-outstanding")
    singles = [
        dataclasses.replace(arrival, index=1000 + arrival.index)  # indices of their own beside the sessions'
        for arrival in poisson(30, rate=4, prompt=(16, 200), output=(4, 40), seed=9)
    ]
    requests = fleet.run(singles, sessions)
    assert all(r.outcome == Outcome.OK for r in requests)
    assert len(requests) == 30 + 20 * 3
    by_index = {r.arrival.index: r for r in requests if r.arrival.session is not None}
    for session in sessions:
        for turn in (1, 2):
            previous, request = by_index[session.index * 3 + turn - 1], by_index[session.index * 3 + turn]
            assert request.arrival.at_s == pytest.approx(previous.token_times_s[-1] + think_s)
            # Routed when it arrived: the replica it went to had not run past that instant by more than a step.
            assert request.token_times_s[0] > request.arrival.at_s
    assert len(set(fleet.assignment.values())) == 4, "least-outstanding spread the turns over the replicas"


def test_session_affinity_keeps_a_conversation_on_one_replica_and_its_cache():
    sessions = conversations(24, turns=4, think_s=0.3)
    runs = {}
    for router in ("least-outstanding", "session-affinity"):
        fleet = Fleet(engine(), 4, router)
        requests = fleet.run([], sessions)
        assert all(r.outcome == Outcome.OK for r in requests)
        runs[router] = (fleet, requests)
    sticky, requests = runs["session-affinity"]
    for session in sessions:
        replicas = {sticky.assignment[session.index * 4 + turn] for turn in range(4)}
        assert len(replicas) == 1, "every turn where the first went"
    assert len(set(sticky.assignment.values())) == 4

    def cached(requests) -> int:
        return sum(r.num_cached_tokens for r in requests if r.arrival.index % 4)

    # Later turns find the conversation before them; scattered over the replicas, they mostly do not.
    assert cached(runs["session-affinity"][1]) > 1.5 * cached(runs["least-outstanding"][1])


def test_a_fleet_run_leaves_nothing_for_the_cycle_collector_it_pauses():
    # A run pauses Python's cycle collector (simulator.cycle_collection_paused): what it makes must go by reference
    # counts alone, or a long run would keep every cycle it made until the collector came back.
    def simulate() -> None:
        faults = [
            (FaultWindow("kill", 2.0, 2.5, None), [0]),
            (FaultWindow("cap", 1.0, 4.0, {"kv_cap": {"fraction": 0.3}}), [1]),
        ]
        fleet = Fleet(engine(300), 3, "session-affinity", faults, admission=AdmissionLimits(ttft_slo_s=2.0))
        singles = [
            dataclasses.replace(arrival, index=1000 + arrival.index)  # apart from the sessions' request indices
            for arrival in poisson(40, rate=10, prompt=(16, 300), output=(1, 100))
        ]
        requests = fleet.run(singles, conversations(8, turns=3))
        assert {request.outcome for request in requests} >= {Outcome.OK, Outcome.BROKEN_STREAM}

    was_enabled = gc.isenabled()
    gc.disable()  # so that no automatic collection takes the cycles away before the count
    try:
        gc.collect()
        simulate()
        assert gc.collect() == 0, "the run left reference cycles"
    finally:
        if was_enabled:
            gc.enable()


def test_a_fleets_clients_retry_their_429s_and_every_request_ends_ok():
    arrivals = [SimulatedArrival(index, 1.0 + index * 0.005, 64, 8) for index in range(12)]
    fleet = Fleet(
        engine(max_num_seqs=1),
        2,
        "round-robin",
        admission=AdmissionLimits(max_waiting=1),
        retry_wait_s=clients_retrying(5),
    )
    requests = fleet.run(arrivals)
    assert [request.outcome for request in requests] == [Outcome.OK] * 12
    assert any(request.attempts > 1 for request in requests)
