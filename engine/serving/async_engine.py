"""The engine loop in a background thread, and one async stream of outputs per request.

    event loop (HTTP)                          engine thread
    -----------------                          -------------
    submit(): validate, admit, inbox += add    loop: take the inbox (adds, aborts) ->
    abort():  inbox += abort                         step() -> outputs ->
    async for output in stream  <-- call_soon_threadsafe -- one batch of deliveries per iteration

The engine (scheduler, block pools, model runner) is only touched by the engine
thread; the event loop talks to it through the lock-protected inbox. A thread,
not a process: torch releases the GIL in its kernels, so the HTTP side keeps
answering during a step, and outputs cross as Python objects with no
serialization; docs/benchmarks.md ("Serving speed") measures what the HTTP
side costs the engine. Whoever builds the engine for a server loads it on a
thread that then exits (``kvstorm serve`` does): torch's OpenMP pool of a
thread that ran a parallel operator lives as long as the thread, and a second
pool beside the engine thread's own makes every operator wake its workers
through the kernel.

Back-pressure: a stream holds at most ``max_buffered_outputs`` outputs its
consumer has not taken. A client that reads slower than the engine generates
is aborted (finish reason ``abort``, logged, counted by phase) rather than
paused: pausing would keep its KV blocks pinned for as long as the client
dawdles, and the blocks are the scarce resource.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.core.admission import AdmissionController, AdmissionLimits, Decision, NewRequest
from engine.core.fault_limits import parse_seconds
from engine.core.interface import EngineClient, InvalidRequest, Prompt
from engine.core.outputs import (
    EngineSnapshot,
    FinishReason,
    PreparedRequest,
    RemainingWork,
    RequestOutput,
    RequestTimings,
    SchedulerStats,
    StepResult,
    StepStats,
)
from engine.core.sampling_params import SamplingParams
from engine.serving.metrics import EngineMetrics

logger = logging.getLogger(__name__)

# Busy loop iterations kept for ``/admin/steps``: minutes of a busy engine.
ITERATION_LOG_SIZE = 20_000


@dataclass(frozen=True)
class IterationTiming:
    """One busy loop iteration: its step, and the time from its start to the next iteration's."""

    step: StepStats
    wall_s: float

    def to_json(self) -> dict[str, float]:
        step = self.step
        return {
            "num_prefill_tokens": step.num_prefill_tokens,
            "num_decodes": step.num_batched_tokens - step.num_prefill_tokens,
            "num_context_tokens": step.num_context_tokens,
            "num_attended_pairs": step.num_attended_pairs,
            "swap_s": step.swap_s,
            "wall_s": self.wall_s,
        }


class EngineFailure(Exception):
    """A step raised: every request in flight ends with this error."""


class RequestStream:
    """One request's outputs in order; the engine thread fills it, one task consumes it."""

    def __init__(self, prepared: PreparedRequest, first_attempt_ts: float | None) -> None:
        self.prepared = prepared
        # A retry's first attempt: its place in line (None for any other request).
        self.first_attempt_ts = first_attempt_ts
        self._queue: asyncio.Queue[RequestOutput | EngineFailure] = asyncio.Queue()
        self.num_pushed = 0  # written by the engine thread only
        self.num_taken = 0  # written by the consumer only
        self.last_token_ts: float | None = None  # engine thread only
        # Admission's predictions of its first token, in seconds from arrival: the uncorrected model's and the
        # corrected one (None when it was not admitted through a prediction).
        self.model_ttft_s: float | None = None
        self.predicted_ttft_s: float | None = None
        self.finished = False  # consumer side: the final output was taken

    @property
    def request_id(self) -> str:
        return self.prepared.request_id

    @property
    def remaining_work(self) -> RemainingWork:
        """The request before the engine has scheduled any of it, as admission's forecast sees it."""
        place_in_line_ts = self.prepared.arrival_ts if self.first_attempt_ts is None else self.first_attempt_ts
        max_tokens = self.prepared.sampling_params.max_tokens
        return RemainingWork(
            self.prepared.num_prompt_tokens, 0, max_tokens, place_in_line_ts, block_hashes=self.prepared.block_hashes
        )

    def put(self, item: RequestOutput | EngineFailure) -> None:
        """On the event loop only."""
        self._queue.put_nowait(item)

    @property
    def num_undelivered(self) -> int:
        return self.num_pushed - self.num_taken

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs up to and including the finished one; raises ``EngineFailure`` if the engine failed."""
        while not self.finished:
            item = await self._queue.get()
            self.num_taken += 1
            if isinstance(item, EngineFailure):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class AsyncEngine:
    """Runs an engine (``EngineClient``) continuously in a thread; ``submit`` returns a ``RequestStream``.

    ``pause`` freezes the loop between steps (nothing is taken from the inbox, no step
    runs) and ``step`` lets a paused loop run a given number of iterations: the hooks a
    test uses to walk the engine step by step. The ``freeze`` fault stops the loop the same
    way for a number of seconds, then it resumes by itself: an engine wedged with requests
    in flight, which ``/health`` reports once ``--stall-timeout`` has passed.
    """

    def __init__(self, engine: EngineClient, metrics: EngineMetrics, limits: AdmissionLimits | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.limits = limits or AdmissionLimits()
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, RequestStream | str]] = []  # ("add", stream) or ("abort", request_id)
        # Requests the loop took from the inbox since the last snapshot: in the engine, not yet in a snapshot.
        self._adds_since_snapshot: list[RequestStream] = []
        self._streams: dict[str, RequestStream] = {}  # in flight, guarded by _cond
        self._iterations_allowed: int | None = None  # None: free-running; n >= 0: n more, then freeze
        self._frozen_until_ts: float | None = None  # the freeze fault
        self._stopping = False
        self._engine_lock = threading.Lock()  # held while the engine thread touches the engine
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_iterations = 0
        self.last_progress_ts = time.monotonic()
        # The last busy iterations: each step's shape and the time from its iteration's start to the next one's,
        # HTTP and streaming contending for the CPU included (what ``kvstorm simulate profile`` fits).
        self.iteration_log: deque[IterationTiming] = deque(maxlen=ITERATION_LOG_SIZE)
        # The engine as of the last loop iteration, published for the HTTP side, and when.
        self._publish(engine.snapshot())
        self.admission = AdmissionController(self.limits, engine.info)
        metrics.observe_admission_limit(self.admission.ttft_limit_s(), *self.admission.corrections())
        metrics.observe_ttft_objective(self.limits.ttft_slo_s, AdmissionController.TAIL_QUANTILE)
        stats = self.snapshot.stats
        metrics.observe_cache_config(
            engine.info.block_size, stats.num_physical_device_blocks, stats.num_physical_host_blocks
        )
        for loop_fault in ("freeze", "engine_paused"):
            metrics.set_fault(loop_fault, False)

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop after its current step; streams still in flight end with an ``EngineFailure``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is None:
            return
        self._thread.join()
        deliveries: list[tuple[RequestStream, RequestOutput | EngineFailure]] = []
        self._fail_all("the server is shutting down", deliveries)
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests (event loop side) -------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        retry_key: str | None = None,
        arrival_ts: float | None = None,
    ) -> RequestStream:
        """Prepare (tokenize, validate) one request on the calling thread and queue it: ``submit_prepared`` of one.
        ``arrival_ts``: when the request reached the server (monotonic; default now), where its latencies start."""
        prepared = self.engine.prepare_request(prompt, params, request_id, arrival_ts)
        return self.submit_prepared([prepared], retry_key)[0]

    def submit_prepared(self, prepared: Sequence[PreparedRequest], retry_key: str | None = None) -> list[RequestStream]:
        """Queue the sequences of one request (each made by ``EngineClient.prepare_request``), all or none, on the
        event loop. One admission decision counts every sequence as a request: ``AdmissionRefused`` if overloaded,
        ``InvalidRequest`` if more sequences than may ever wait at once, and then none was queued. Nothing in here
        awaits, so a caller holds the streams of whatever was queued before it can be cancelled. ``retry_key``: the
        same for the same request sent again (admission keeps its Retry-After promises by it)."""
        max_waiting = self.limits.max_waiting
        if max_waiting is not None and len(prepared) > max_waiting:
            raise InvalidRequest(
                f"{len(prepared)} sequences in one request, but at most {max_waiting} may wait at once "
                "(--max-waiting): it could never be admitted",
                "n",
            )
        sequences = [NewRequest(p.num_prompt_tokens, p.sampling_params.max_tokens, block_hashes=p.block_hashes)
                     for p in prepared]  # fmt: skip
        started = time.perf_counter()
        decision, model_ttft_s = self._decide(dataclasses.replace(sequences[-1], retry_key=retry_key), sequences[:-1])
        self.metrics.observe_admission_decision(time.perf_counter() - started)
        if decision.honoured_retry:
            self.metrics.observe_retry(admitted=decision.refusal is None)
        if decision.refusal is not None:
            raise decision.refusal
        self.metrics.observe_admitted(decision.ttft_s)
        streams = [RequestStream(one, decision.first_attempt_ts) for one in prepared]
        # The prediction is the last sequence's (the others are ahead of it): only its first token can judge it.
        streams[-1].model_ttft_s, streams[-1].predicted_ttft_s = model_ttft_s, decision.ttft_s
        with self._cond:
            if not self._streams:
                self.last_progress_ts = time.monotonic()  # the stall clock starts when work arrives
            for stream in streams:
                self._streams[stream.request_id] = stream
                self._inbox.append(("add", stream))
            self._cond.notify()
        return streams

    def abort(self, request_id: str) -> None:
        """Abort in the next loop iteration (a no-op if the request has finished by then)."""
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stalled_for_s(self) -> float:
        """Seconds with requests in flight and no completed loop iteration; 0 when idle."""
        return time.monotonic() - self.last_progress_ts if self._streams else 0.0

    def overload_reasons(self) -> list[str]:
        """Why a new one-token request would be refused now; empty when it would be admitted."""
        refusal = self._decide(NewRequest(num_prompt_tokens=1, max_tokens=1))[0].refusal
        return [] if refusal is None else [str(refusal)]

    def _decide(self, new: NewRequest, siblings: Sequence[NewRequest] = ()) -> tuple[Decision, float]:
        with self._cond:
            snapshot, elapsed_s = self.snapshot, time.monotonic() - self.snapshot_ts
            in_engine = [stream.remaining_work for stream in self._adds_since_snapshot]
            arriving = [item.remaining_work for kind, item in self._inbox if kind == "add"]
        return self.admission.decide(snapshot, elapsed_s, in_engine, arriving, new, siblings=siblings)

    # ---- run-time control (admin) ---------------------------------------------------------------

    def pause(self) -> None:
        with self._cond:
            self._iterations_allowed = 0
        self.metrics.set_fault("engine_paused", True)

    def resume(self) -> None:
        with self._cond:
            self._iterations_allowed = None
            self._cond.notify()
        self.metrics.set_fault("engine_paused", False)

    def update_faults(self, **changes: object) -> dict[str, object]:
        """Change faults: the engine's (``engine.faults``) and ``freeze`` (seconds the loop stops for, from now;
        null or 0 ends a freeze). ``ValueError`` for a bad one, and then nothing changes; no changes to read them.
        Returns every fault's value (``freeze``: the seconds left) and ``active``, the names of those on now (the
        engine's rule: what a harness shows as a fault window). Waits for the step in progress."""
        freeze = {"freeze": changes.pop("freeze")} if "freeze" in changes else {}
        freeze_s = parse_seconds("freeze", 0 if freeze.get("freeze") is None else freeze["freeze"])
        with self._engine_lock:
            faults = self.engine.update_faults(**changes)
            self._publish(self.engine.snapshot())
        if freeze:
            self._freeze(freeze_s)
        return self._fault_values(faults)

    def clear_faults(self) -> dict[str, object]:
        """Every fault off, the freeze ended; returns every fault's value. A delay in progress ends within a slice,
        before the step it slows finishes."""
        self.engine.cut_fault_delays()
        with self._engine_lock:
            faults = self.engine.clear_faults()
            self._publish(self.engine.snapshot())
        self._freeze(0.0)
        return self._fault_values(faults)

    def reset_prefix_cache(self) -> dict[str, object]:
        """Forget every cached prefix (what a benchmark does between runs, to start cold); waits for the step in
        progress."""
        with self._engine_lock:
            num_forgotten = self.engine.reset_prefix_cache()
            self._publish(self.engine.snapshot())
        return {"num_cached_blocks_forgotten": num_forgotten}

    def _fault_values(self, engine_faults: dict[str, object]) -> dict[str, object]:
        freeze_s = self.freeze_remaining_s
        active = [name for name, on in self.snapshot.active_faults.items() if on] + ["freeze"] * (freeze_s is not None)
        return {**engine_faults, "freeze": freeze_s, "active": sorted(active)}

    @property
    def freeze_remaining_s(self) -> float | None:
        until = self._frozen_until_ts
        remaining = None if until is None else until - time.monotonic()
        return remaining if remaining is not None and remaining > 0 else None

    def _freeze(self, duration_s: float) -> None:
        with self._cond:
            self._frozen_until_ts = time.monotonic() + duration_s if duration_s > 0 else None
            self._cond.notify()
        self.metrics.set_fault("freeze", duration_s > 0)

    @property
    def is_paused(self) -> bool:
        return self._iterations_allowed is not None

    async def step(self, num_iterations: int = 1) -> None:
        """On a paused engine: run ``num_iterations`` loop iterations (inbox, then one step) and return after."""
        with self._cond:
            if self._iterations_allowed is None:
                raise ValueError("the engine is not paused; pause it before stepping")
            target = self.num_iterations + self._iterations_allowed + num_iterations
            self._iterations_allowed += num_iterations
            self._cond.notify()
        while self.num_iterations < target and self.is_running:
            await asyncio.sleep(0.002)

    def describe(self) -> dict[str, object]:
        """Pools, queues and every live request's phase; blocks until the current step ends (run it off-loop)."""
        with self._engine_lock:
            snapshot = self.engine.snapshot(include_requests=True)
        with self._cond:
            pending = [(kind, item if isinstance(item, str) else item.request_id) for kind, item in self._inbox]
        return {
            "engine": dataclasses.asdict(self.engine.info),
            "paused": self.is_paused,
            "frozen_for_s": self.freeze_remaining_s,
            "num_iterations": self.num_iterations,
            "num_in_flight": self.num_in_flight,
            "stats": dataclasses.asdict(snapshot.stats),
            # What the engine measures as it runs: what a recompute and a swap cost its preemption policy.
            "prefill_tokens_per_s": snapshot.prefill_tokens_per_s,
            "copy_bytes_per_s": snapshot.copy_bytes_per_s,
            "prefix_cache": _prefix_cache_summary(self.engine.info.enable_prefix_caching, snapshot.stats),
            "requests": {
                r.request_id: {k: v for k, v in dataclasses.asdict(r).items() if k != "request_id"}
                for r in snapshot.requests
            },
            "pending_adds": [request_id for kind, request_id in pending if kind == "add"],
            "pending_aborts": [request_id for kind, request_id in pending if kind == "abort"],
        }

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._iterate_until_stopped()
        except BaseException:
            # A bug outside step() (which has its own handler): /health reports the dead loop, and no stream hangs.
            logger.exception("the engine loop died")
            deliveries: list[tuple[RequestStream, RequestOutput | EngineFailure]] = []
            self._fail_all("the engine loop died", deliveries)
            self._loop.call_soon_threadsafe(_deliver, deliveries)
            raise

    def _iterate_until_stopped(self) -> None:
        # The step of the iteration before, and when that iteration started: timed once this one starts, unless
        # the loop waited in between.
        previous: tuple[StepStats, float] | None = None
        while True:
            with self._cond:
                while not self._stopping and not self._may_iterate():
                    previous = None
                    self._cond.wait(timeout=self.freeze_remaining_s)  # a freeze ends by itself
                    self.metrics.set_fault("freeze", self.freeze_remaining_s is not None)
                if self._stopping:
                    return
                commands, self._inbox = self._inbox, []
                self._adds_since_snapshot = [item for kind, item in commands if kind == "add"]
                if self._iterations_allowed:
                    self._iterations_allowed -= 1
            deliveries: list[tuple[RequestStream, RequestOutput | EngineFailure]] = []
            started = time.monotonic()
            if previous is not None:
                self.iteration_log.append(IterationTiming(previous[0], started - previous[1]))
            with self._engine_lock:
                self._apply(commands, deliveries)
                result = self._step(deliveries) if self.engine.has_unfinished_requests() else None
                snapshot = result.snapshot if result is not None else self.engine.snapshot()
                last_step = snapshot.last_step if result is not None else None
                if last_step is not None:
                    self.metrics.observe_step(last_step, self.engine.info.bytes_per_block)
                    self.admission.observe_iteration(last_step, time.monotonic() - started)
                self._publish(snapshot)
            previous = (last_step, started) if last_step is not None and last_step.error is None else None
            self.last_progress_ts = time.monotonic()
            self.num_iterations += 1
            if deliveries:
                self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _may_iterate(self) -> bool:
        if self.freeze_remaining_s is not None:
            return False
        if self._iterations_allowed is not None:  # paused: only the iterations granted by step()
            return self._iterations_allowed > 0
        return bool(self._inbox) or self.engine.has_unfinished_requests()

    def _apply(self, commands, deliveries) -> None:
        for kind, item in commands:
            if kind == "add":
                self.engine.add_prepared_request(item.prepared, item.first_attempt_ts)
                self.metrics.observe_added(item.prepared.num_prompt_tokens)
            else:
                self._abort(item, "client", deliveries)

    def _abort(self, request_id: str, reason: str, deliveries) -> None:
        final = self.engine.abort_request(request_id)
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if final is None or stream is None:  # finished before the abort arrived
            return
        self.metrics.observe_abort(final.aborted_in, reason)
        self.metrics.observe_finished(final.timings, final.finish_reason)
        deliveries.append((stream, final))

    def _step(self, deliveries) -> StepResult | None:
        """One engine step and its deliveries; None if the step raised (every request in flight then ends)."""
        try:
            result = self.engine.step()
        except Exception as error:  # any failure of a step ends the requests in flight, not the loop
            logger.exception("engine step failed; ending every request in flight")
            self._fail_all(f"engine step failed: {type(error).__name__}: {error}", deliveries)
            return None
        now = time.monotonic()
        with self._cond:  # once per step, not per output
            streams = [self._streams.get(output.request_id) for output in result.outputs]
        for output, stream in zip(result.outputs, streams, strict=True):
            if stream is not None:
                self._deliver_output(stream, output, now, deliveries)
        return result

    def _deliver_output(self, stream: RequestStream, output: RequestOutput, now: float, deliveries) -> None:
        if output.new_token_ids:
            gap_s = None if stream.last_token_ts is None else now - stream.last_token_ts
            self.metrics.observe_tokens(output.timings, len(output.new_token_ids), gap_s, output.num_cached_tokens)
            if gap_s is None and stream.model_ttft_s is not None:
                self._learn_from_first_token(stream, output.timings)
            stream.last_token_ts = now
        stream.num_pushed += 1
        # A request the engine gave up on alone (finish reason "error") ends its stream as an engine failure.
        deliveries.append((stream, EngineFailure(output.error) if output.error is not None else output))
        if output.finished:
            with self._cond:
                self._streams.pop(output.request_id, None)
            self.metrics.observe_finished(output.timings, output.finish_reason)
        elif stream.num_undelivered > self.limits.max_buffered_outputs:
            logger.warning(
                "aborting %s: its client has not taken %d outputs (limit %d)",
                stream.request_id,
                stream.num_undelivered,
                self.limits.max_buffered_outputs,
            )
            self._abort(stream.request_id, "slow_client", deliveries)

    def _learn_from_first_token(self, stream: RequestStream, timings: RequestTimings) -> None:
        observed_s = timings.first_token_ts - timings.arrival_ts
        self.admission.observe_first_token(stream.model_ttft_s, observed_s)
        self.metrics.observe_first_token_prediction(stream.predicted_ttft_s, observed_s)
        self.metrics.observe_admission_limit(self.admission.ttft_limit_s(), *self.admission.corrections())

    def _fail_all(self, message: str, deliveries) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            final = None
            try:
                final = self.engine.abort_request(stream.request_id)
            except Exception:  # the engine is broken already
                logger.exception("abort of %s after a failed step failed too", stream.request_id)
            # Without the engine's account, the request's own: it arrived, and it ends now.
            timings = final.timings if final is not None else RequestTimings(stream.prepared.arrival_ts)
            self.metrics.observe_finished(timings, FinishReason.ERROR)
            deliveries.append((stream, EngineFailure(message)))

    def _publish(self, snapshot: EngineSnapshot) -> None:
        with self._cond:
            self.snapshot, self.snapshot_ts = snapshot, time.monotonic()
            self._adds_since_snapshot = []
        self.metrics.observe_snapshot(snapshot)


def _deliver(deliveries: list[tuple[RequestStream, RequestOutput | EngineFailure]]) -> None:
    """On the event loop: hand each output to its stream."""
    for stream, item in deliveries:
        stream.put(item)


def _prefix_cache_summary(enabled: bool, stats: SchedulerStats) -> dict[str, object]:
    """Whether prefix caching is on, and since the engine started the share of prompt tokens looked up at admission
    that were found cached (None before any lookup)."""
    queried, hit = stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens
    return {
        "enabled": enabled,
        "hit_rate": hit / queried if queried else None,
        "queried_tokens": queried,
        "hit_tokens": hit,
        "cached_blocks": stats.num_cached_device_blocks,
        "evictable_blocks": stats.num_evictable_device_blocks,
        "evictions": stats.prefix_cache_evictions,
    }
