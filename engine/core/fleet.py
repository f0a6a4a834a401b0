"""A fleet of simulated engines behind a router, on one virtual clock.

Each replica is a ``Simulation`` of its own (its pools, its scheduler, its fault timeline). Before each arrival every
replica runs up to that instant, so the router sees them as they are then, and the router picks one:

- ``round-robin``: replica i mod N for the i-th request;
- ``least-outstanding``: the one with the fewest unfinished requests (the lowest index on a tie);
- ``prefix-affinity``: the replica its prompt's first block hashes to, so that requests sharing a prefix meet the
  same prefix cache (least-outstanding for a prompt shorter than a block);
- ``session-affinity``: every turn of a multi-turn session to the replica its first turn went to (least-outstanding
  then, and for single requests), as a balancer with sticky sessions, so that a turn meets the cache of the one
  before it.

A replica that is down (killed) refuses what it is sent, as a load balancer without health checks would let happen.
Other than with ``session-affinity``, each turn of a multi-turn session is routed on its own, when it arrives.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from engine.core.admission import AdmissionLimits
from engine.core.simulator import (
    FaultWindow,
    RetryWait,
    SimulatedArrival,
    SimulatedEngine,
    SimulatedRequest,
    SimulatedSession,
    Simulation,
    SimulationResult,
    as_request,
    cycle_collection_paused,
)

ROUTERS = ("round-robin", "least-outstanding", "prefix-affinity", "session-affinity")


class Fleet:
    def __init__(
        self,
        engine: SimulatedEngine,
        num_replicas: int,
        router: str,
        faults: Sequence[tuple[FaultWindow, Sequence[int]]] = (),
        request_timeout_s: float = 600.0,
        admission: AdmissionLimits | None = None,
        retry_wait_s: RetryWait | None = None,
    ) -> None:
        """``faults``: each window with the replicas it hits; ``admission``: every replica's limits; ``retry_wait_s``:
        the clients' (``Simulation``'s); a retry is routed again, as a new connection is."""
        if num_replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {num_replicas}")
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; routers: {', '.join(ROUTERS)}")
        for window, replicas in faults:
            if not replicas or not all(0 <= index < num_replicas for index in replicas):
                raise ValueError(f"fault {window.name!r}: replicas {list(replicas)} are not among 0-{num_replicas - 1}")
        self.replicas = [
            Simulation(
                engine,
                faults=[window for window, hit in faults if index in hit],
                request_timeout_s=request_timeout_s,
                admission=admission,
                retry_wait_s=retry_wait_s,
            )
            for index in range(num_replicas)
        ]
        # The router's method, unbound: a bound one kept on the fleet would make a reference cycle, which the cycle
        # collector, paused while a run goes, would be left to find.
        self._route: Callable[[Fleet, SimulatedArrival], int] = {
            "round-robin": Fleet._round_robin,
            "least-outstanding": Fleet._least_outstanding,
            "prefix-affinity": Fleet._prefix_affinity,
            "session-affinity": Fleet._session_affinity,
        }[router]
        self._turns = itertools.cycle(range(num_replicas))
        # Which replica each request went to, by its index.
        self.assignment: dict[int, int] = {}

    def run(
        self, arrivals: Sequence[SimulatedArrival], sessions: Sequence[SimulatedSession] = ()
    ) -> list[SimulatedRequest]:
        """Every request, each in the order of arrival, as its client saw it."""
        with cycle_collection_paused():
            if sessions:
                self._run_with_sessions(arrivals, sessions)
            else:
                pending = self._pending(arrivals)
                while pending:
                    at_s, _, item = heapq.heappop(pending)
                    for replica in self.replicas:
                        replica.advance_until(at_s)
                    self._submit(item, pending)
            for replica in self.replicas:
                replica.advance_until(math.inf)
                replica.finish()
        return self._in_order([request for replica in self.replicas for request in replica.result.requests])

    def _run_with_sessions(self, arrivals: Sequence[SimulatedArrival], sessions: Sequence[SimulatedSession]) -> None:
        """A session's next turn is known only when the answer before it ends, on whichever replica: the replicas
        move in rounds, none past the earliest instant a next turn could arrive (a busy replica's clock, plus the
        token's way to its client and the think time), and each stops at a step that answered a turn. An arrival
        is routed once every replica has reached it (each, as for any arrival, may be up to a step past it)."""
        engine = self.replicas[0].engine
        for replica in self.replicas:
            replica.has_sessions = True
        first_turns = [session.first_arrival(engine.block_size, engine.enable_prefix_caching) for session in sessions]
        pending = self._pending([*arrivals, *first_turns])
        gap_s = engine.token_latency_s + min(session.think_s for session in sessions)
        while True:
            until_s = pending[0][0] if pending else math.inf
            busy_since = [r.t for r in self.replicas if r.scheduler.has_unfinished_requests()]
            if not busy_since and until_s == math.inf:
                return
            horizon_s = until_s
            if busy_since:  # at least one step of the replica furthest behind, so that the rounds move on
                earliest = min(busy_since)
                horizon_s = min(until_s, max(earliest + gap_s, math.nextafter(earliest, math.inf)))
            for replica in self.replicas:
                replica.advance_until(horizon_s)
                for follow_up in replica.take_follow_ups():
                    heapq.heappush(pending, (follow_up.at_s, follow_up.index, follow_up))
            while pending and all(replica.t >= pending[0][0] for replica in self.replicas):
                self._submit(heapq.heappop(pending)[2], pending)

    @staticmethod
    def _pending(arrivals: Sequence[SimulatedArrival]) -> list[tuple[float, int, SimulatedArrival | SimulatedRequest]]:
        """What arrives, in order of arrival: a heap that retries join as their clients send them again."""
        pending: list[tuple[float, int, SimulatedArrival | SimulatedRequest]] = [
            (arrival.at_s, arrival.index, arrival) for arrival in arrivals
        ]
        heapq.heapify(pending)
        return pending

    def _submit(
        self,
        item: SimulatedArrival | SimulatedRequest,
        pending: list[tuple[float, int, SimulatedArrival | SimulatedRequest]],
    ) -> None:
        """Route ``item`` (a request, or a retry of one) to a replica; a refusal that its client retries joins
        ``pending``."""
        request = as_request(item)
        chosen = self._route(self, request.arrival)
        self.assignment[request.arrival.index] = chosen
        replica = self.replicas[chosen]
        replica.submit(request)
        for at_s, retry in replica.take_retries():
            heapq.heappush(pending, (at_s, retry.arrival.index, retry))

    @staticmethod
    def _in_order(requests: list[SimulatedRequest]) -> list[SimulatedRequest]:
        return sorted(requests, key=lambda r: (r.arrival.at_s, r.arrival.index))

    def merged(self, requests: list[SimulatedRequest]) -> SimulationResult:
        """The fleet as one engine: every request, counts summed, the last replica's end (each keeps its steps)."""
        results = [replica.result for replica in self.replicas]
        merged = SimulationResult(requests, end_s=max(result.end_s for result in results))
        for result in results:
            merged.num_failed_steps += result.num_failed_steps
            merged.num_swapped_out_blocks += result.num_swapped_out_blocks
            merged.num_swapped_in_blocks += result.num_swapped_in_blocks
            merged.num_steps += result.num_steps
            for mode, count in result.preemptions.items():
                merged.preemptions[mode] += count
        return merged

    def _round_robin(self, arrival: SimulatedArrival) -> int:
        return next(self._turns)

    def _least_outstanding(self, arrival: SimulatedArrival) -> int:
        return min(range(len(self.replicas)), key=lambda index: self.replicas[index].num_outstanding)

    def _prefix_affinity(self, arrival: SimulatedArrival) -> int:
        if not arrival.block_hashes:
            return self._least_outstanding(arrival)
        return int.from_bytes(arrival.block_hashes[0][:8], "big") % len(self.replicas)

    def _session_affinity(self, arrival: SimulatedArrival) -> int:
        session = arrival.session
        if session is None:
            return self._least_outstanding(arrival)
        return self.assignment.get(session.request_index(0), self._least_outstanding(arrival))
