"""The engine in virtual time: the real scheduler, KV cache manager, preemption policy and step back-off, with a
step-cost model (``engine.core.step_cost``) where the model runner would be.

Every rule is the engine's own: ``Scheduler.plan_step`` decides each step (budget, chunked prefill, watermark,
preemption by swap or recompute chosen by the same policy, which learns from the simulated step times as the engine's
learns from measured ones, prefix caching) and ``engine.core.virtual_run.advance`` moves it on, as the admission
forecast does. A step takes what the cost model says for its shape, plus its block moves, plus the faults active at
its start; a token reaches its client the engine's token latency after the step that sampled it ends. A request
produces all its ``max_tokens`` (the load's exact-output mode: a simulator cannot know a stop token). While every
running request only decodes, steps go in one run (``engine.core.virtual_run.DecodeRun``) that takes arrivals in
through the scheduler's own phases and keeps the running requests' progress lazily: the same decisions and
times at a cost per request rather than per request per step.

Faults follow a timeline of windows, each set at its start and cleared at its end as a chaos experiment's rollback
clears it: the engine's run-time faults (``engine.core.fault_limits.FaultValues``: a KV cap, a swap cap, a slow host
link, slow steps, out-of-memory steps), or a kill (every stream in the engine breaks, requests arriving while it is
down are refused, and it restarts empty, with no fault, at the window's end).

Multi-turn sessions (``SimulatedSession``): a turn's answer, once it reached its client, sends the next turn after a
think time, with the conversation so far as its prompt.

Admission control is the server's own (``engine.core.admission``): each arrival is decided on the snapshot the engine
had published when it arrived (the state after the last step that had ended, the step then in progress started that
long ago) with the requests taken in or admitted since, and the controller learns from every simulated step and
first token as the server's learns from measured ones. A refused request ends as a 429, unless its client retries
(``retries``): it arrives again after the delay its client waits, the same request to admission (which keeps the
place in line of one that comes back when told), its times still from its first send.

What it does not model: the serving layer's costs beyond what the step-cost model and the token latency were fitted
on, and clients that stall (a client gives up only after its request timeout).
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.admission import AdmissionController, AdmissionLimits, AdmissionRefused, NewRequest
from engine.core.block_hash import BlockHash, extend_block_hashes
from engine.core.block_pool import BlockPool
from engine.core.config import PreemptionMode, SchedulerConfig
from engine.core.fault_limits import FaultValues
from engine.core.kv_cache_manager import KVCacheManager, num_blocks_for
from engine.core.outputs import (
    PROBE_DECODE_ROWS,
    PROBE_PROMPT_TOKENS,
    EngineInfo,
    EngineSnapshot,
    FinishReason,
    RemainingWork,
    StepCosts,
)
from engine.core.preemption import PreemptionPolicy
from engine.core.scheduler import Scheduler
from engine.core.step_cost import StepShape
from engine.core.virtual_run import DecodeRun, RunStep, RunStepOutcome, VirtualRequest, advance

# (HTTP status, Retry-After, sends so far, seconds the request timeout leaves) -> seconds to wait, or None: no retry.
RetryWait = Callable[[int, str, int, float], float | None]


class StepCost(Protocol):
    swap_block_s: float

    def step_s(self, shape: StepShape) -> float: ...


@contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Python's cycle collector off for a simulation: a run makes millions of small objects and no reference cycles
    (a test checks), so the collector would only walk them again and again, more often the longer the run (13% of
    a run of a million requests). Everything a run drops is freed by its reference count all the same."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class SimulatedEngine:
    """The engine simulated: its pools, rules and step costs."""

    num_device_blocks: int
    num_host_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    scheduler_config: SchedulerConfig
    cost: StepCost
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    # From the end of the step that made a token to the client holding it: the server's event loop, the socket, the
    # client's parsing. It shifts every token alike, so it adds to TTFT and E2E, not to the gaps between tokens.
    token_latency_s: float = 0.0

    def step_costs(self) -> StepCosts:
        """What the engine would measure at start-up: the cost model's price of the same probe steps."""
        step_s, last = self.cost.step_s, PROBE_PROMPT_TOKENS - 1
        return StepCosts.from_probes(
            step_s(StepShape.of_batch([(0, PROBE_PROMPT_TOKENS)])),
            PROBE_PROMPT_TOKENS,
            step_s(StepShape.of_batch([(last, 1)])),
            step_s(StepShape.of_batch([(last - row, 1) for row in range(PROBE_DECODE_ROWS)])),
            PROBE_DECODE_ROWS,
        )

    def info(self) -> EngineInfo:
        """The engine as admission control sees it (what does not change while it runs)."""
        return EngineInfo(
            model="simulated",
            device="simulated",
            dtype="simulated",
            dtype_choice="simulated",
            max_model_len=self.max_model_len,
            vocab_size=0,
            block_size=self.block_size,
            bytes_per_block=self.bytes_per_block,
            attention_backend="simulated",
            matmul="simulated",
            layer_ops="simulated",
            scheduler_config=self.scheduler_config,
            watermark=self.watermark,
            step_costs=self.step_costs(),
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why the engine refuses such a request before it starts (a 400), or None."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            return (
                f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) exceeds the context ({self.max_model_len})"
            )
        if num_blocks_for(total, self.block_size) > self.num_device_blocks:
            return f"it needs more KV blocks than the whole pool ({self.num_device_blocks})"
        return None


@dataclass(frozen=True)
class SimulatedArrival:
    """A request as it reaches the server: when, and what it asks for."""

    index: int
    at_s: float
    num_prompt_tokens: int
    max_tokens: int
    # Its prompt's full blocks (``engine.core.block_hash``): what a prefix cache can find of it.
    block_hashes: tuple[BlockHash, ...] = ()
    # The conversation it is a turn of, if any.
    session: SimulatedSession | None = None


@dataclass(frozen=True)
class SimulatedTurn:
    """One turn of a conversation: the tokens it adds to the conversation so far (the first turn: its whole prompt),
    and the answer it asks for."""

    num_new_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class SimulatedSession:
    """A multi-turn conversation (``loadgen.sessions``): its first turn arrives at ``at_s``; each later one
    ``think_s`` after the answer before it reached its client, if that answer ended ok, and sends the whole
    conversation: the previous prompt, the previous answer and its own new tokens. Its first
    ``num_shared_tokens`` are the same in every session (a system prompt); its request indices are
    ``index * len(turns) + turn``."""

    index: int
    at_s: float
    turns: tuple[SimulatedTurn, ...]
    think_s: float = 0.0
    num_shared_tokens: int = 0

    def request_index(self, turn_index: int) -> int:
        return self.index * len(self.turns) + turn_index

    def turn_of(self, arrival: SimulatedArrival) -> int:
        """Which of its turns (from 0) ``arrival`` is."""
        return arrival.index - self.request_index(0)

    def first_arrival(self, block_size: int, hashed: bool) -> SimulatedArrival:
        turn = self.turns[0]
        shared = min(self.num_shared_tokens, turn.num_new_tokens)
        # Token ids stand in for the text only as far as prefix caching looks at them: equal where the sessions'
        # prompts are equal, the session's own elsewhere.
        token_ids = [*range(shared), *[self._marker(0)] * (turn.num_new_tokens - shared)]
        return self._arrival(0, self.at_s, token_ids, block_size, hashed)

    def next_arrival(self, answered: SimulatedRequest, block_size: int, hashed: bool) -> SimulatedArrival | None:
        """The turn after ``answered`` (which ended ok), or None after the last."""
        turn_index = self.turn_of(answered.arrival) + 1
        if turn_index == len(self.turns):
            return None
        # The conversation so far is cached as the engine computed it: the previous prompt and answer (the answer
        # as it was generated; a server that tokenizes its text again may find a block or two less), then new tokens.
        previous = answered.num_tokens
        new = self.turns[turn_index].num_new_tokens
        token_ids = [0] * previous + [self._marker(turn_index)] * new
        hashes = list(answered.block_hashes[: previous // block_size]) if hashed else []
        at_s = answered.token_times_s[-1] + self.think_s
        return self._arrival(turn_index, at_s, token_ids, block_size, hashed, hashes)

    def _arrival(
        self,
        turn_index: int,
        at_s: float,
        token_ids: list[int],
        block_size: int,
        hashed: bool,
        hashes: list[BlockHash] | None = None,
    ) -> SimulatedArrival:
        hashes = hashes or []
        if hashed:
            extend_block_hashes(hashes, token_ids, block_size)
        return SimulatedArrival(
            self.request_index(turn_index),
            at_s,
            len(token_ids),
            self.turns[turn_index].max_tokens,
            tuple(hashes),
            self,
        )

    def _marker(self, turn_index: int) -> int:
        return -1 - self.request_index(turn_index)


@dataclass(frozen=True)
class FaultWindow:
    """``changes`` (``/admin/faults`` values) from ``start_s`` to ``end_s``; ``changes`` None: the engine is killed at
    ``start_s`` and serves again at ``end_s``."""

    name: str
    start_s: float
    end_s: float
    changes: dict[str, object] | None

    def __post_init__(self) -> None:
        if not 0 <= self.start_s < self.end_s < math.inf:
            raise ValueError(f"fault {self.name!r}: needs 0 <= start < end, got {self.start_s} and {self.end_s}")
        if self.changes is not None:
            FaultValues().validated(self.changes)
            if "memory_hog" in self.changes:
                raise ValueError("memory_hog is not simulated: the simulator has no device memory outside its pools")


class Outcome:
    """How a request ended for its client: the load generator's outcome classes (``loadgen.records.Outcome``), which
    the engine does not import."""

    OK = "ok"
    REJECTED = "rejected"
    BROKEN_STREAM = "broken_stream"
    CLIENT_TIMEOUT = "client_timeout"


class SimulatedRequest(VirtualRequest):
    """A request with what its client would see: when each token arrived and how it ended."""

    __slots__ = ("arrival", "attempts", "error", "model_ttft_s", "outcome", "sent_at_s", "token_times_s")

    def __init__(self, arrival: SimulatedArrival) -> None:
        super().__init__(
            str(arrival.index),
            RemainingWork(
                arrival.num_prompt_tokens, 0, arrival.max_tokens, arrival.at_s, block_hashes=arrival.block_hashes
            ),
        )
        self.arrival = arrival
        self.token_times_s: list[float] = []
        self.outcome: str | None = None
        self.error = ""
        # Admission's uncorrected prediction of its first token, from its arrival (None: not predicted).
        self.model_ttft_s: float | None = None
        # Sends of it (more than one: its client retried a 429), and when the last reached the server.
        self.attempts = 1
        self.sent_at_s = arrival.at_s


@dataclass
class StepSample:
    """The engine after one step: what a Prometheus scrape would read then."""

    end_s: float
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    num_preemptions: dict[str, int]


@dataclass
class SimulationResult:
    requests: list[SimulatedRequest]
    steps: list[StepSample] = field(default_factory=list)
    # Steps whose forward pass failed (out-of-memory faults), preemptions by mode, blocks moved each way.
    num_failed_steps: int = 0
    preemptions: dict[str, int] = field(
        default_factory=lambda: {mode.value: 0 for mode in (PreemptionMode.SWAP, PreemptionMode.RECOMPUTE)}
    )
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_steps: int = 0
    end_s: float = 0.0


def as_request(item: SimulatedArrival | SimulatedRequest) -> SimulatedRequest:
    """What arrives: a new request, or one its client sends again."""
    return item if isinstance(item, SimulatedRequest) else SimulatedRequest(item)


def _record_tokens(request: SimulatedRequest, delivered_s: list[float]) -> None:
    request.token_times_s.extend(delivered_s)


class Simulation:
    """One run of ``engine`` under ``arrivals`` and ``faults``; ``run`` returns what every request saw. A fleet
    (``engine.core.fleet``) drives it request by request instead: ``advance_until``, ``submit``, ``finish``."""

    def __init__(
        self,
        engine: SimulatedEngine,
        arrivals: Sequence[SimulatedArrival] = (),
        faults: Sequence[FaultWindow] = (),
        request_timeout_s: float = 600.0,
        keep_steps: bool = True,
        check_invariants: bool = False,
        fast_forward: bool = True,
        sessions: Sequence[SimulatedSession] = (),
        admission: AdmissionLimits | None = None,
        retry_wait_s: RetryWait | None = None,
    ) -> None:
        """``admission``: the server's admission limits (None, or none set: every request is admitted).
        ``retry_wait_s``: how long a client waits before it sends a request refused with 429 again, or None: it does
        not (``loadgen.client.retry_wait_s`` with its retries; None: no client retries)."""
        self.engine = engine
        self.retry_wait_s = retry_wait_s
        # (when, request): refused requests whose clients send them again then.
        self.retrying: list[tuple[float, SimulatedRequest]] = []
        self.admission_limits = admission if admission is not None and admission.limits_anything else None
        self.arrivals: list[SimulatedArrival] = []
        # With sessions, a step that ends a turn ends ``advance_until`` too: the next turn may arrive before whatever
        # the caller waits for.
        self.has_sessions = False
        self.answered_turns: list[tuple[SimulatedRequest, SimulatedSession]] = []
        self.add_load(arrivals, sessions)
        self.request_timeout_s = request_timeout_s
        self.keep_steps = keep_steps
        # After every step, the block and queue invariants the engine's debug flag checks (tests).
        self.check_invariants = check_invariants
        # Runs of decode steps in one go (``_run_decodes``); off, every step is planned on its own (tests).
        self.fast_forward = fast_forward
        self.decode_run: DecodeRun | None = None
        # (time, order, window, starts): the timeline's boundaries in order; a clear before a set at one instant.
        self.boundaries = sorted(
            [(w.start_s, 1, i, w, True) for i, w in enumerate(faults)]
            + [(w.end_s, 0, i, w, False) for i, w in enumerate(faults)]
        )
        self.next_boundary = 0
        self.faults = FaultValues()
        self.is_down = False  # killed, until its restart
        self.t = 0.0
        # When the engine last did something a client could see (a step, an arrival, a client giving up): where the
        # run ends, not at a fault boundary crossed after the last request.
        self.last_event_s = 0.0
        # (when its client gives up, its index, the request)
        self.deadlines: list[tuple[float, int, SimulatedRequest]] = []
        self.result = SimulationResult([])
        self.scheduler = self._fresh_scheduler()
        self._fresh_admission()

    def add_load(self, arrivals: Sequence[SimulatedArrival], sessions: Sequence[SimulatedSession] = ()) -> None:
        """More for ``run`` to send: single requests, and sessions whose first turns arrive as they start."""
        hashed = self.engine.enable_prefix_caching
        self.arrivals += [*arrivals, *(session.first_arrival(self.engine.block_size, hashed) for session in sessions)]
        self.has_sessions = self.has_sessions or bool(sessions)

    def run(self) -> SimulationResult:
        """Every arrival in turn (a session's later turns as their answers come, a retry when its client sends it
        again), then on until the engine has nothing left to do."""
        pending: list[tuple[float, int, SimulatedArrival | SimulatedRequest]] = [
            (arrival.at_s, arrival.index, arrival) for arrival in self.arrivals
        ]
        heapq.heapify(pending)
        with cycle_collection_paused():
            while True:
                self.advance_until(pending[0][0] if pending else math.inf)
                if self.answered_turns:
                    for follow_up in self.take_follow_ups():
                        heapq.heappush(pending, (follow_up.at_s, follow_up.index, follow_up))
                    continue
                if not pending:
                    return self.finish()
                self.submit(as_request(heapq.heappop(pending)[2]))
                for at_s, request in self.take_retries():
                    heapq.heappush(pending, (at_s, request.arrival.index, request))

    def take_retries(self) -> list[tuple[float, SimulatedRequest]]:
        """The refused requests whose clients send them again, and when (since the last call)."""
        retries, self.retrying = self.retrying, []
        return retries

    def take_follow_ups(self) -> list[SimulatedArrival]:
        """The next turns of the sessions whose turns were answered since the last call."""
        engine = self.engine
        follow_ups = [
            session.next_arrival(answered, engine.block_size, engine.enable_prefix_caching)
            for answered, session in self.answered_turns
        ]
        self.answered_turns.clear()
        return [follow_up for follow_up in follow_ups if follow_up is not None]

    def advance_until(self, until_s: float) -> None:
        """Run steps until the clock reaches ``until_s`` (the step in progress may end after it), crossing the fault
        timeline's boundaries and the clients' deadlines as they come, in the order they came; an idle engine's clock
        jumps to what comes next. With ``until_s`` infinite: until nothing is left to do."""
        while True:
            # Not past ``until_s``: a request arriving then, before a kill, was streaming when the kill came.
            self._cross_boundaries(min(self.t, until_s))
            # Most deadlines are of requests that ended long before: those go as they come to the top, so that
            # ``later`` is a deadline that can still come.
            deadlines = self.deadlines
            while deadlines and (deadlines[0][0] <= self.t or deadlines[0][2].outcome is not None):
                self._time_out(heapq.heappop(deadlines)[2])
            if self.t >= until_s:
                return
            busy = self.scheduler.has_unfinished_requests()
            later = min(until_s, self._next_boundary_s())
            if busy and self.deadlines:
                later = min(later, self.deadlines[0][0])
            if busy:
                if self.fast_forward and self._run_decodes(later):
                    if self.answered_turns:
                        return
                    continue
                duration_s = self._step(self.t)
                if duration_s:
                    self.t += duration_s
                    self.last_event_s = self.t
                    if self.answered_turns:
                        return
                    continue
            # Idle, or nothing it holds can run now (under a cap): on to whatever comes next.
            if later == math.inf:
                return
            self.t = max(self.t, later)

    def submit(self, request: SimulatedRequest) -> None:
        """A request reaches the engine now (the clock has reached its arrival, or its retry's)."""
        if request.attempts == 1:
            self.result.requests.append(request)
        self.last_event_s = max(self.last_event_s, self.t)
        if self._admit(request):
            deadline_s = request.arrival.at_s + self.request_timeout_s
            heapq.heappush(self.deadlines, (deadline_s, request.arrival.index, request))

    def finish(self) -> SimulationResult:
        self._close_decode_run()
        for request in list(self.scheduler.requests.values()):  # nothing left could ever run them
            self._time_out(request)
        self.result.end_s = self.last_event_s
        return self.result

    @property
    def num_outstanding(self) -> int:
        """Requests in the engine, unfinished (what a least-outstanding router compares)."""
        return len(self.scheduler.requests)

    def _next_boundary_s(self) -> float:
        return self.boundaries[self.next_boundary][0] if self.next_boundary < len(self.boundaries) else math.inf

    def _cross_boundaries(self, until_s: float) -> None:
        while self._next_boundary_s() <= until_s:
            self._cross(self.boundaries[self.next_boundary])
            self.next_boundary += 1

    # ---- steps --------------------------------------------------------------------------------

    def _run_decodes(self, until_s: float) -> bool:
        """Steps of the open decode run (``engine.core.virtual_run.DecodeRun``; opened if none is and one can be)
        until the clock reaches ``until_s`` (the step in progress may end after it), a turn of a session ends, or the
        run cannot go on (it is then closed): a running request needs a block the pool lacks, one taken in part is
        not the newest, or one waits where a step must be planned on its own (admission decides arrivals on the
        engine's snapshot between steps; an out-of-memory fault prices the whole batch). False when no step ran."""
        scheduler, faults = self.scheduler, self.faults
        run = self.decode_run
        if run is None:
            if not self._can_run_decodes():
                return False
            run = self.decode_run = DecodeRun(scheduler, _record_tokens)
        # Every step of every run goes through this loop: what it calls is looked up once.
        step_s_of, step_delay, latency_s = self.engine.cost.step_s, faults.step_delay, self.engine.token_latency_s
        waiting, admission, t = scheduler.waiting, self.admission, self.t
        stays_open = admission is None
        num_steps_before = run.num_steps
        while t < until_s:
            if (waiting or run.prefilling) and (admission is not None or faults.oom_above_batched_tokens is not None):
                stays_open = False
                break
            # An arrival during a step is decided on the snapshot from before it: that step is planned alone.
            if admission is not None and t + step_s_of(run.decode_shape()) + step_delay > until_s:
                break
            planned = run.plan()
            if planned is None:  # a block the pool lacks, or nothing runs: the scheduler plans what comes next
                stays_open = False
                break
            step_s = step_s_of(planned.shape) + step_delay
            if not run.stamps:
                self._begin_step(t)
            t += step_s
            outcome = run.commit(planned, t + latency_s)
            if admission is not None:
                admission.observe_step(0, planned.num_decodes, step_s)
            for request in outcome.finished:
                self._end(request, Outcome.OK)
            if planned.batch:
                self._took_in(planned, outcome, step_s, t + latency_s)
                stays_open = stays_open and not outcome.must_close
            if outcome.finished or planned.batch:
                if self.check_invariants:
                    scheduler.check_invariants()
                if self.keep_steps:
                    self._sample(t)
                if not stays_open or (outcome.finished and self.has_sessions):  # a turn's end sends the next turn
                    break
        self.t = t
        ran = run.num_steps > num_steps_before
        if ran:
            self.result.num_steps += run.num_steps - num_steps_before
            self.last_event_s = t
        if not stays_open or not ran:
            self._close_decode_run()
        return ran

    def _can_run_decodes(self) -> bool:
        """Whether a decode run can start (``DecodeRun.can_start``) with no fault failing a step."""
        faults, running = self.faults, self.scheduler.running
        if faults.fail_next_steps or (
            faults.oom_above_batched_tokens is not None and len(running) > faults.oom_above_batched_tokens
        ):
            return False
        return DecodeRun.can_start(self.scheduler)

    def _took_in(self, planned: RunStep, outcome: RunStepOutcome, step_s: float, delivered_s: float) -> None:
        """A run's step took requests in: the preemption policy learns from a prefill-heavy step, as the engine's
        does; a first token reaches its client, and a request of one token is done."""
        self._learn_prefill_speed(planned.shape, step_s)
        for request in outcome.sampled:
            request.token_times_s.append(delivered_s)
            if request.num_remaining_outputs <= 0:
                self._end(request, Outcome.OK)

    def _learn_prefill_speed(self, shape: StepShape, step_s: float) -> None:
        """The preemption policy learns the speed of recompute from a step that is mostly prefill, as the engine's
        does (``LLMEngine._record``)."""
        num_batched_tokens = shape.num_prefill_tokens + shape.num_decodes
        if shape.num_prefill_tokens > num_batched_tokens // 2:
            self.scheduler.preemption_policy.observe_prefill(num_batched_tokens, step_s)

    def _close_decode_run(self) -> None:
        """Bring every request of the open decode run (if any) up to date: the scheduler's state is whole again."""
        run, self.decode_run = self.decode_run, None
        if run is None:
            return
        run.close()
        if run.num_steps:
            self._end_step()
            if self.check_invariants:
                self.scheduler.check_invariants()

    def _step(self, t: float) -> float:
        """Plan and run one step starting at ``t``; its duration, or 0 when nothing could be scheduled."""
        scheduler, cost, result = self.scheduler, self.engine.cost, self.result
        plan = scheduler.plan_step()
        num_moved = len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)
        if not plan.batch and not num_moved and not plan.preemptions:
            return 0.0
        self._begin_step(t)
        result.num_steps += 1
        for event in plan.preemptions:
            result.preemptions[event.mode.value] += 1
        result.num_swapped_out_blocks += len(plan.blocks_to_swap_out)
        result.num_swapped_in_blocks += len(plan.blocks_to_swap_in)
        swap_s = num_moved * cost.swap_block_s + self.faults.block_moves_delay_s(num_moved) if num_moved else 0.0
        num_batched_tokens = plan.num_batched_tokens
        failure = self.faults.take_step_failure(num_batched_tokens) if plan.batch else None
        shape = StepShape.of_batch([(r.num_computed_tokens, n) for r, n in plan.batch] if failure is None else [])
        duration_s = swap_s + self.faults.step_delay + cost.step_s(shape)
        end_s = t + duration_s
        if failure is not None:
            result.num_failed_steps += 1
            if scheduler.back_off.on_failure(len(plan.batch), num_batched_tokens):
                victim = plan.batch[0][0]
                scheduler.finish_request(victim.request_id, FinishReason.ERROR)
                self._end(victim, Outcome.BROKEN_STREAM, f"the engine gave up on it after failed steps: {failure}")
        else:
            delivered_s, admission = end_s + self.engine.token_latency_s, self.admission
            for request in advance(scheduler, plan):
                token_times_s = request.token_times_s
                token_times_s.append(delivered_s)
                if admission is not None and len(token_times_s) == 1 and request.model_ttft_s is not None:
                    admission.observe_first_token(request.model_ttft_s, end_s - request.sent_at_s)
                if request.num_remaining_outputs <= 0:
                    self._end(request, Outcome.OK)
            self._learn_prefill_speed(shape, duration_s)
            if admission is not None:
                admission.observe_step(shape.num_prefill_tokens, shape.num_decodes, duration_s)
        scheduler.preemption_policy.observe_swap(num_moved, swap_s)
        self._end_step()
        if self.check_invariants:
            scheduler.check_invariants()
        if self.keep_steps:
            self._sample(end_s)
        return duration_s

    def _sample(self, end_s: float) -> None:
        stats = self.scheduler.stats()
        self.result.steps.append(
            StepSample(
                end_s=end_s,
                num_running=stats.num_running,
                num_waiting=stats.num_waiting,
                num_swapped=stats.num_swapped,
                kv_usage=1 - stats.num_free_device_blocks / max(stats.num_device_blocks, 1),
                num_preemptions=dict(self.result.preemptions),
            )
        )

    # ---- requests in and out ------------------------------------------------------------------

    def _admit(self, request: SimulatedRequest) -> bool:
        arrival = request.arrival
        if self.is_down:
            self._end(request, Outcome.REJECTED, "connection refused: the engine is down (killed)")
            return False
        refusal = self.engine.fits(arrival.num_prompt_tokens, arrival.max_tokens)
        if refusal is not None:
            self._end(request, Outcome.REJECTED, f"400: {refusal}")
            return False
        if self.admission is not None:
            busy = self._decide(request)
            if busy is not None:
                if not self._retry(request, busy):
                    self._end(request, Outcome.REJECTED, f"429: {busy}")
                return False
        self.scheduler.add_request(request)
        return True

    # ---- admission ----------------------------------------------------------------------------

    def _fresh_admission(self) -> None:
        """A controller that has learnt nothing yet (at the start, and at a restart), and the engine as published."""
        limits = self.admission_limits
        self.admission = None if limits is None else AdmissionController(limits, self.engine.info())
        if self.admission is None:
            return
        # What the engine published after the last step that ended, and after the one before (what a request arriving
        # during the last step was decided on); when the last step started, and the requests it took in (admitted
        # after the one before had ended); the requests admitted since the last step ended.
        self._published = self._published_before = self._snapshot()
        self._step_start_s = 0.0
        self._taken_by_step: list[RemainingWork] = []
        self._admitted: list[RemainingWork] = []

    def _snapshot(self) -> EngineSnapshot:
        return self.scheduler.snapshot(self.faults.active())

    def _begin_step(self, t: float) -> None:
        if self.admission is not None:
            self._step_start_s = t
            self._taken_by_step, self._admitted = self._admitted, []

    def _end_step(self) -> None:
        if self.admission is not None:
            self._published_before, self._published = self._published, self._snapshot()

    def _decide(self, request: SimulatedRequest) -> AdmissionRefused | None:
        """Why admission refuses ``request`` (arriving now), or None: it is admitted, with its prediction kept and its
        place in line (a retry that came back when told keeps its first send's)."""
        arrival, sent_at_s = request.arrival, request.sent_at_s
        if self._step_start_s <= sent_at_s < self.t:  # it came while the last step ran
            snapshot, elapsed_s, in_engine = (
                self._published_before,
                sent_at_s - self._step_start_s,
                self._taken_by_step,
            )
        else:  # between steps, or a fleet's replica has run past it: what it published last
            snapshot, elapsed_s, in_engine = self._published, 0.0, []
        # A client sends the same request again: the server knows it by its body and its sender.
        new = NewRequest(
            arrival.num_prompt_tokens, arrival.max_tokens, str(arrival.index), block_hashes=arrival.block_hashes
        )
        decision, model_ttft_s = self.admission.decide(
            snapshot, elapsed_s, in_engine, self._admitted, new, now=sent_at_s
        )
        if decision.refusal is not None:
            return decision.refusal
        request.model_ttft_s = model_ttft_s
        request.place_in_line_ts = arrival.at_s if decision.honoured_retry else sent_at_s
        self._admitted.append(new.work._replace(place_in_line_ts=request.place_in_line_ts))
        return None

    def _retry(self, request: SimulatedRequest, refusal: AdmissionRefused) -> bool:
        """Whether ``request``'s client sends it again after ``refusal`` (then it is queued to arrive again)."""
        if self.retry_wait_s is None:
            return False
        time_left_s = request.arrival.at_s + self.request_timeout_s - request.sent_at_s
        wait_s = self.retry_wait_s(429, str(refusal.retry_after_s), request.attempts, time_left_s)
        if wait_s is None:
            return False
        again_s = request.sent_at_s + wait_s
        request.attempts += 1
        request.sent_at_s = again_s
        self.retrying.append((again_s, request))
        return True

    def _time_out(self, request: SimulatedRequest) -> None:
        if request.outcome is not None:
            return
        self._close_decode_run()
        self.last_event_s = max(self.last_event_s, self.t)
        self.scheduler.abort_request(request.request_id)
        self._end(request, Outcome.CLIENT_TIMEOUT, f"no end within the request timeout ({self.request_timeout_s:g} s)")

    def _end(self, request: SimulatedRequest, outcome: str, error: str = "") -> None:
        request.outcome, request.error = outcome, error
        if outcome == Outcome.OK and (session := request.arrival.session) is not None:
            self.answered_turns.append((request, session))

    # ---- faults -------------------------------------------------------------------------------

    def _cross(self, boundary: tuple[float, int, int, FaultWindow, bool]) -> None:
        _, _, _, window, starts = boundary
        self._close_decode_run()
        if window.changes is None:
            if starts:
                self._kill(window)
            else:
                self.is_down = False
            return
        if self.is_down:
            return  # a fault set or cleared on a dead engine: its restart starts with none
        changes = window.changes if starts else {name: FaultValues().to_json()[name] for name in window.changes}
        self.faults.apply(self.faults.validated(changes))
        self.faults.cap_pools(self.scheduler.kv.device_pool, self.scheduler.kv.host_pool)

    def _kill(self, window: FaultWindow) -> None:
        for request in list(self.scheduler.requests.values()):
            self._end(request, Outcome.BROKEN_STREAM, f"the engine was killed ({window.name})")
        self.is_down = True
        self.faults = FaultValues()
        self.scheduler = self._fresh_scheduler()
        self._fresh_admission()

    def _fresh_scheduler(self) -> Scheduler:
        engine = self.engine
        kv = KVCacheManager(
            BlockPool(engine.num_device_blocks, "device"),
            BlockPool(engine.num_host_blocks, "host"),
            engine.block_size,
            engine.enable_prefix_caching,
        )
        swap_block_s = engine.cost.swap_block_s
        policy = PreemptionPolicy(
            engine.scheduler_config.preemption_mode,
            engine.bytes_per_block,
            engine.bytes_per_block / swap_block_s if swap_block_s > 0 else 1e15,
            # The engine's first estimate of recompute: its start-up prefill probe (LLMEngine.load).
            engine.step_costs().prompt_tokens_per_s(PROBE_PROMPT_TOKENS),
        )
        return Scheduler(engine.scheduler_config, kv, policy, engine.watermark)
