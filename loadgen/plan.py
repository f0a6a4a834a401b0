"""A run's plan, decided from its configuration before anything is sent, and its shards.

The plan is a pure function of the configuration (the seed draws arrivals, lengths and prompts), so every worker
process of a sharded run (:mod:`loadgen.workers`) plans the same run and keeps its own share: request (or session)
``i`` belongs to shard ``i mod N``. A Poisson process thinned that way is N Poisson processes, each at 1/N of the
rate, and the instants of the whole stay exactly those planned.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loadgen.arrivals import ARRIVAL_KINDS, expected_num_arrivals, make_arrivals
from loadgen.client import StreamingClient
from loadgen.records import RequestRecord
from loadgen.results import RunConfig
from loadgen.runner import RunStart, RunTiming, run_open_loop
from loadgen.sessions import SessionPlan, build_sessions, run_sessions
from loadgen.spec import parse_spec
from loadgen.workloads import (
    WORKLOAD_KINDS,
    PlannedRequest,
    build_plan,
    is_session_workload,
    jsonl_mean_lengths,
    mean_length,
)

# The most tokens a plan may ask for (prompts sent plus outputs asked for, and shared prefixes). A plan is built whole
# before its first request leaves, and by every process of a sharded run: a token-id prompt is a list of Python ints,
# 41 bytes a token (measured), so 100 M tokens is about 4 GB, what a machine that generates load can hold beside its
# records. A larger run is an operator's who means it (``kvstorm bench serve --force``), never a controller caller's.
MAX_PLAN_TOKENS = 100_000_000


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


class PlanTooLarge(ValueError):
    """A plan whose expected size is above ``MAX_PLAN_TOKENS``: refused before it is built."""


@dataclass(frozen=True)
class PlanSize:
    """What a plan is expected to ask for, worked out from its specs without building it."""

    num_requests: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    # The shared-prefix workload's prefixes, built once beside the prompts that repeat them.
    num_prefixes: int = 0
    prefix_len: int = 0

    @property
    def num_tokens(self) -> float:
        per_request = self.mean_prompt_tokens + self.mean_output_tokens
        return self.num_requests * per_request + self.num_prefixes * self.prefix_len

    def describe(self) -> str:
        words = (
            f"{self.num_requests:,.0f} requests x ({self.mean_prompt_tokens:,.0f} prompt + "
            f"{self.mean_output_tokens:,.0f} output tokens)"
        )
        if self.num_prefixes:
            words += f" + {self.num_prefixes:,} prefixes x {self.prefix_len:,} tokens"
        return f"{words} = {self.num_tokens:,.0f} tokens"

    def check(self, remedy: str = "") -> None:
        """``PlanTooLarge`` naming the product and the bound when the plan is above ``MAX_PLAN_TOKENS``."""
        if self.num_tokens > MAX_PLAN_TOKENS:
            raise PlanTooLarge(
                f"the plan asks for {self.describe()}, above the bound of {MAX_PLAN_TOKENS:,} tokens a plan may hold "
                f"(loadgen.plan.MAX_PLAN_TOKENS: about 4 GB of prompts in the load client){remedy}"
            )


def estimate_plan_size(
    arrival: str,
    workload: str,
    *,
    input_len: str,
    output_len: str,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> PlanSize:
    """The expected size of the plan ``plan_run`` would build from these settings: the arrivals' expected count (a
    trace's own count and lengths) times the mean prompt and output tokens of the workload, multi-turn sessions'
    conversations and shared prefixes included. Nothing is drawn or built but a trace's or a jsonl file's rows."""
    spec = parse_spec(workload, WORKLOAD_KINDS)
    mean_input, mean_output = mean_length(input_len), mean_length(output_len)
    if parse_spec(arrival, ARRIVAL_KINDS).kind == "trace":
        arrivals = make_arrivals(arrival, num_requests=num_requests, duration_s=duration_s)
        num_arrivals: float = len(arrivals)
        # A trace's own lengths win over the distributions (as in ``build_plan``).
        mean_input = sum(a.prompt_len or mean_input for a in arrivals) / max(1, len(arrivals))
        mean_output = sum(a.output_len or mean_output for a in arrivals) / max(1, len(arrivals))
    else:
        num_arrivals = expected_num_arrivals(arrival, num_requests=num_requests, duration_s=duration_s)
    if spec.kind == "shared-prefix":
        num_prefixes, prefix_len = spec.get_int("num_prefixes", minimum=1), spec.get_int("prefix_len", minimum=1)
        return PlanSize(num_arrivals, prefix_len + mean_input, mean_output, num_prefixes, prefix_len)
    if spec.kind == "multiturn":
        # Turn k sends the system prompt, k user messages and the k - 1 answers before it: the mean over T turns.
        num_turns, system_len = spec.get_int("turns", minimum=1), spec.get_int("system_len", 0, minimum=0)
        mean_prompt = system_len + mean_input * (num_turns + 1) / 2 + mean_output * (num_turns - 1) / 2
        return PlanSize(num_arrivals * num_turns, mean_prompt, mean_output)
    if spec.kind == "jsonl":
        return PlanSize(num_arrivals, *jsonl_mean_lengths(workload, mean_output))
    return PlanSize(num_arrivals, mean_input, mean_output)


def plan_size(config: RunConfig) -> PlanSize:
    """``estimate_plan_size`` of a run's configuration."""
    return estimate_plan_size(
        config.arrival,
        config.workload,
        input_len=config.input_len,
        output_len=config.output_len,
        num_requests=config.num_requests,
        duration_s=config.duration_s,
    )
