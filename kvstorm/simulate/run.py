"""One simulated run: the load generator's plan for a ``RunConfig`` (the same seed gives the same arrivals, prompts and
lengths as ``kvstorm bench serve``) through one simulated engine or a fleet of them behind a router
(``engine.core.fleet``), written as the ``RunResult`` a real run writes.

The server's side of the run (KV usage, running / waiting / swapped, preemptions per second) comes as the series a
Prometheus server would have given a real run, sampled after each simulated step, so the report draws it alike.
"""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.admission import AdmissionLimits
from engine.core.block_hash import BlockHash, extend_block_hashes
from engine.core.fleet import Fleet
from engine.core.simulator import FaultWindow, SimulatedArrival, SimulatedEngine, SimulatedRequest, StepSample
from engine.core.simulator import SimulationResult as EngineSimulation
from kvstorm.admission_options import describe_admission
from kvstorm.simulate.conversations import ChatTokens, EstimatedTokens, simulated_sessions
from loadgen.analysis import advisories, parse_slos, summarize
from loadgen.client import retry_wait_s
from loadgen.plan import plan_run
from loadgen.records import Outcome, RequestRecord
from loadgen.results import FaultWindow as ReportedWindow
from loadgen.results import PromSeries, RunConfig, RunResult

SIMULATED_NOTE = (
    "Simulated, not measured: the engine's own scheduler, KV cache, preemption and admission control in virtual time, "
    "each step priced by the profile {profile!r}. Admission {admission}. Every stream runs to its max_tokens, "
    "{retries}, and the way to the client (the server's event loop, the network, the client) adds {latency_ms:.1f} ms "
    "to every token."
)


def open_loop_load(
    base_url: str,
    model: str,
    arrival: str,
    input_len: str,
    output_len: str,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    workload: str = "random",
) -> RunConfig:
    """An open-loop load with exact output lengths (by default of random token-id prompts): what the simulator's
    benchmarks and its profile's measuring load send (to a real server, or to the simulated one)."""
    return RunConfig(
        base_url=base_url,
        model=model,
        arrival=arrival,
        workload=workload,
        input_len=input_len,
        output_len=output_len,
        num_requests=num_requests,
        duration_s=duration_s,
        max_concurrency=None,
        request_timeout_s=600.0,
        stall_timeout_s=120.0,
        exact_output=True,
        seed=seed,
        slo=None,
    )


@dataclass(frozen=True)
class SimulatedRun:
    result: RunResult
    engine_side: EngineSimulation
    wall_s: float


def simulate(
    config: RunConfig,
    engine: SimulatedEngine,
    profile_name: str,
    faults: Sequence[tuple[FaultWindow, Sequence[int]]] = (),
    bucket_s: float = 1.0,
    replicas: int = 1,
    router: str = "round-robin",
    chat_tokens: ChatTokens | None = None,
    admission: AdmissionLimits | None = None,
) -> SimulatedRun:
    """``faults``: each window with the replicas it hits (0 for one engine). ``chat_tokens``: how a multi-turn
    load's text is counted in tokens (default: estimated from its words). ``admission``: the server's limits (None:
    every request is admitted)."""
    slos = parse_slos(config.slo)
    plan = plan_run(config)
    chat_tokens = chat_tokens or EstimatedTokens()
    sessions = [] if plan.sessions is None else simulated_sessions(plan.sessions, chat_tokens)
    arrivals = []
    for planned in plan.requests:
        prompt = planned.body.get("prompt")
        if not isinstance(prompt, list):
            raise ValueError(
                f"{config.workload!r}: the simulator needs prompts as token ids (random, shared-prefix, a trace); "
                "text prompts would need the server's tokenizer"
            )
        hashes: list[BlockHash] = []
        if engine.enable_prefix_caching:
            extend_block_hashes(hashes, prompt, engine.block_size)
        arrivals.append(
            SimulatedArrival(planned.index, planned.offset_s, len(prompt), planned.max_tokens, tuple(hashes))
        )
    started = time.perf_counter()
    admission = admission or AdmissionLimits()
    fleet = Fleet(
        engine,
        replicas,
        router,
        faults,
        request_timeout_s=config.request_timeout_s,
        admission=admission,
        retry_wait_s=functools.partial(retry_wait_s, config.retries) if config.retries else None,
    )
    engine_side = fleet.merged(fleet.run(arrivals, sessions))
    wall_s = time.perf_counter() - started
    shared = {planned.index: planned.shared_prefix_tokens for planned in plan.requests}
    records = [_record(request, shared) for request in engine_side.requests]
    duration_s = max([engine_side.end_s, *(r.end_s for r in records)])
    summary = summarize(records, duration_s, slos, plan.num_turns)
    notes = [
        SIMULATED_NOTE.format(
            profile=profile_name,
            admission=describe_admission(admission),
            retries=(
                f"a client sends a request refused with 429 again after its Retry-After, up to {config.retries} times"
                if config.retries
                else "a refused client does not retry"
            ),
            latency_ms=engine.token_latency_s * 1e3,
        )
    ]
    if sessions:
        notes.append(
            f"Multi-turn: each turn's new tokens (template and user message) are {chat_tokens.description}. A turn "
            "finds the conversation before it in the prefix cache as the engine computed it (the answer as it was "
            "generated); a server that tokenizes the answer's text again may find a block or two less."
        )
    if replicas > 1:
        notes.append(
            f"A fleet of {replicas} replicas of that engine behind a {router} router; the server series are "
            "the fleet's: KV usage averaged over the replicas, requests and preemptions summed."
        )
    notes += advisories(summary, records, exact_output=True, max_concurrency=None)
    start_unix = time.time()
    return SimulatedRun(
        RunResult(
            run_id=uuid.uuid4().hex[:8],
            start_unix=start_unix,
            start_ts=0.0,
            config=config,
            summary=summary,
            advisories=notes,
            records=records,
            fault_windows=[
                ReportedWindow(
                    name=w.name + _replicas_label(hit, replicas),
                    start_unix=start_unix + w.start_s,
                    end_unix=start_unix + w.end_s,
                )
                for w, hit in faults
            ],
            prometheus=_server_series([r.result.steps for r in fleet.replicas], start_unix, bucket_s),
        ),
        engine_side,
        wall_s,
    )


def _record(request: SimulatedRequest, shared: dict[int, int]) -> RequestRecord:
    """``shared``: each single request's shared prefix tokens by index (a session's turn shares the turn before)."""
    arrival, times = request.arrival, request.token_times_s
    session, turn = None, None
    shared_prefix_tokens = shared.get(arrival.index, 0)
    if arrival.session is not None:
        session, turn = arrival.session.index, arrival.session.turn_of(arrival) + 1
        if turn > 1:
            shared_prefix_tokens = arrival.num_prompt_tokens - arrival.session.turns[turn - 1].num_new_tokens
    outcome = Outcome(request.outcome)
    started = outcome in (Outcome.OK, Outcome.BROKEN_STREAM) or (outcome is Outcome.CLIENT_TIMEOUT and times)
    return RequestRecord(
        index=arrival.index,
        request_id=f"sim-{arrival.index}",
        scheduled_s=arrival.at_s,
        sent_s=arrival.at_s,
        outcome=outcome,
        error=request.error,
        http_status=200 if started else _refusal_status(request.error),
        attempts=request.attempts,
        finish_reason="length" if outcome is Outcome.OK else None,
        ttft_s=times[0] - arrival.at_s if times else None,
        e2e_s=times[-1] - arrival.at_s if outcome is Outcome.OK else None,
        itl_s=[later - earlier for earlier, later in itertools.pairwise(times)],
        prompt_tokens=arrival.num_prompt_tokens,
        output_tokens=len(times),
        delivered_tokens=len(times),
        usage_completion_tokens=len(times) if outcome is Outcome.OK else None,
        requested_output_tokens=arrival.max_tokens,
        cached_tokens=request.num_cached_tokens,
        shared_prefix_tokens=shared_prefix_tokens,
        session=session,
        turn=turn,
    )


def _refusal_status(error: str) -> int | None:
    """The HTTP status of a request refused before it started (400: it cannot fit; 429: admission), None: no answer
    (the engine was down)."""
    status = error[:3]
    return int(status) if status in ("400", "429") else None


def _replicas_label(hit: Sequence[int], replicas: int) -> str:
    if replicas == 1:
        return ""
    return f" on {len(hit)} of {replicas} replicas" if len(hit) < replicas else " on every replica"


def _server_series(replica_steps: list[list[StepSample]], start_unix: float, bucket_s: float) -> list[PromSeries]:
    """At the end of each bucket, each replica as its last step left it (what a scrape then reads), over the fleet:
    KV usage averaged, requests summed; preemptions per second summed."""
    last_in_bucket = [{int(step.end_s // bucket_s): step for step in steps} for steps in replica_steps]
    num_buckets = max((max(buckets) + 1 for buckets in last_in_bucket if buckets), default=0)
    names = ("KV cache usage", "running", "waiting", "swapped", "preemptions/s")
    points: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    latest: list[StepSample | None] = [None] * len(replica_steps)
    previous_preemptions = 0
    for bucket in range(num_buckets):
        for index, buckets in enumerate(last_in_bucket):
            latest[index] = buckets.get(bucket, latest[index])
        states = [step for step in latest if step is not None]
        if not states:
            continue
        preemptions = sum(sum(step.num_preemptions.values()) for step in states)
        at = start_unix + (bucket + 1) * bucket_s
        for name, value in (
            ("KV cache usage", sum(step.kv_usage for step in states) / len(replica_steps)),
            ("running", sum(step.num_running for step in states)),
            ("waiting", sum(step.num_waiting for step in states)),
            ("swapped", sum(step.num_swapped for step in states)),
            ("preemptions/s", (preemptions - previous_preemptions) / bucket_s),
        ):
            points[name].append((at, float(value)))
        previous_preemptions = preemptions
    return [PromSeries(name=name, query="simulated", points=values) for name, values in points.items() if values]
