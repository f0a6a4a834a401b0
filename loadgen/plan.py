"""A run's plan, decided from its configuration before anything is sent, and its shards.

The plan is a pure function of the configuration (the seed draws arrivals, lengths and prompts), so every worker
process of a sharded run (:mod:`loadgen.workers`) plans the same run and keeps its own share: request (or session)
``i`` belongs to shard ``i mod N``. A Poisson process thinned that way is N Poisson processes, each at 1/N of the
rate, and the instants of the whole stay exactly those planned.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loadgen.arrivals import make_arrivals
from loadgen.client import StreamingClient
from loadgen.records import RequestRecord
from loadgen.results import RunConfig
from loadgen.runner import RunStart, RunTiming, run_open_loop
from loadgen.sessions import SessionPlan, build_sessions, run_sessions
from loadgen.workloads import PlannedRequest, build_plan, is_session_workload


@dataclass(frozen=True)
class RunPlan:
    """Single requests (``requests``), or multi-turn sessions (``sessions``, and ``requests`` empty)."""

    requests: list[PlannedRequest]
    sessions: SessionPlan | None = None

    @property
    def num_requests(self) -> int:
        """Requests the plan sends if no session is cut short."""
        return self.sessions.num_requests if self.sessions is not None else len(self.requests)

    @property
    def num_turns(self) -> int | None:
        return self.sessions.num_turns if self.sessions is not None else None

    def shard(self, index: int, count: int) -> RunPlan:
        """The requests (or sessions) whose index is ``index`` mod ``count``, at their planned instants."""
        if not 0 <= index < count:
            raise ValueError(f"shard {index} of {count} does not exist")
        if self.sessions is not None:
            kept = [s for s in self.sessions.sessions if s.index % count == index]
            return RunPlan([], replace(self.sessions, sessions=kept))
        return RunPlan([r for r in self.requests if r.index % count == index])

    async def run(
        self, client: StreamingClient, max_concurrency: int | None, start: RunStart | None = None
    ) -> tuple[list[RequestRecord], RunTiming]:
        if self.sessions is not None:
            return await run_sessions(self.sessions, client, max_concurrency=max_concurrency, start=start)
        return await run_open_loop(self.requests, client, max_concurrency=max_concurrency, start=start)


def plan_run(config: RunConfig) -> RunPlan:
    arrivals = make_arrivals(
        config.arrival, num_requests=config.num_requests, duration_s=config.duration_s, seed=config.seed
    )
    if not arrivals:
        raise ValueError(f"{config.arrival!r} schedules no request within the run's bounds")
    lengths = {"input_len": config.input_len, "output_len": config.output_len, "seed": config.seed}
    if is_session_workload(config.workload):
        return RunPlan([], build_sessions(arrivals, config.workload, **lengths))
    return RunPlan(build_plan(arrivals, config.workload, **lengths))
