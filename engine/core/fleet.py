"""A fleet of simulated engines behind a router, on one virtual clock.

Each replica is a ``Simulation`` of its own (its pools, its scheduler, its fault timeline). Before each arrival every
replica runs up to that instant, so the router sees them as they are then, and the router picks one:

- ``round-robin``: replica i mod N for the i-th request;
- ``least-outstanding``: the one with the fewest unfinished requests (the lowest index on a tie);
- ``prefix-affinity``: the replica its prompt's first block hashes to, so that requests sharing a prefix meet the
  same prefix cache (least-outstanding for a prompt shorter than a block).

A replica that is down (killed) refuses what it is sent, as a load balancer without health checks would let happen.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from engine.core.simulator import (
    FaultWindow,
    SimulatedArrival,
    SimulatedEngine,
    SimulatedRequest,
    SimulatedSession,
    Simulation,
    SimulationResult,
)

ROUTERS = ("round-robin", "least-outstanding", "prefix-affinity")


class Fleet:
    def __init__(
        self,
        engine: SimulatedEngine,
        num_replicas: int,
        router: str,
        faults: Sequence[tuple[FaultWindow, Sequence[int]]] = (),
        request_timeout_s: float = 600.0,
    ) -> None:
        """``faults``: each window with the replicas it hits."""
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
            )
            for index in range(num_replicas)
        ]
        self._route: Callable[[SimulatedArrival], int] = {
            "round-robin": self._round_robin,
            "least-outstanding": self._least_outstanding,
            "prefix-affinity": self._prefix_affinity,
        }[router]
        self._turns = itertools.cycle(range(num_replicas))
        # Which replica each request went to, by its index.
        self.assignment: dict[int, int] = {}

    def run(
        self, arrivals: Sequence[SimulatedArrival], sessions: Sequence[SimulatedSession] = ()
    ) -> list[SimulatedRequest]:
        """Every request, each in the order of arrival, as its client saw it. Sessions (multi-turn) run on one
        replica only: this fleet moves every replica up to each arrival it knows of beforehand, and a turn becomes
        known only when the answer before it ends."""
        if sessions:
            if len(self.replicas) > 1:
                raise ValueError("multi-turn sessions are simulated on one engine, not on a fleet of replicas yet")
            self.replicas[0].add_load(arrivals, sessions)
            return self._in_order(self.replicas[0].run().requests)
        for arrival in sorted(arrivals, key=lambda a: (a.at_s, a.index)):
            for replica in self.replicas:
                replica.advance_until(arrival.at_s)
            chosen = self._route(arrival)
            self.assignment[arrival.index] = chosen
            self.replicas[chosen].submit(SimulatedRequest(arrival))
        for replica in self.replicas:
            replica.advance_until(math.inf)
            replica.finish()
        return self._in_order([request for replica in self.replicas for request in replica.result.requests])

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
