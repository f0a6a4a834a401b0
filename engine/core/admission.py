"""Admission control: refuse a request before it starts (429 with Retry-After) when the engine predicts that it would
miss its time-to-first-token objective, or when the queue is past a hard limit.

Three parts, each fed by what the engine really does:

- ``StepTimeModel``: how long one engine iteration takes, as a linear function of its prefill tokens and decodes,
  fitted online (exponentially forgetting least squares) to every iteration the engine runs. A slower machine, a
  bigger model or a KV cap that makes steps slower all move it within a few hundred steps.
- ``engine.core.forecast``: runs the engine's own scheduler forward from its snapshot (the running batch decoding
  and finishing, prefills chunked under the token budget, preemptions, queued requests admitted in order while
  seats, KV blocks and a cap allow, blocks returning as requests finish) with the step-time model's durations,
  until a new request would get its first token. So a prediction counts what the engine is busy with, not only the
  prompts that wait.
- ``AdmissionController``: the feedback loop. For every admitted request it keeps the ratio of the first-token
  time the engine then observed to the model's prediction. The median corrects the central prediction (what the
  metrics report); the 95th percentile is the margin admission uses, so that a model that runs slow or fast, or
  a step the model cannot see (preemption, a swap, a fault), tightens or loosens admission within a window of
  requests, as a gradient concurrency limiter tightens its limit on observed latency. It also keeps the
  Retry-After promises: the same request back after its Retry-After takes its place in line from its first
  attempt (ahead of the requests that arrived since) and may use the whole objective, where a new request gets
  part of it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.core.forecast import FORECAST_HORIZON_S, TPOT_DECODES, forecast
from engine.core.outputs import BlockHash, EngineInfo, EngineSnapshot, RemainingWork, StepCosts, StepStats


class AdmissionRefused(Exception):
    """Admission control refused a request before it started; retry after ``retry_after_s``."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdmissionLimits:
    """None disables a limit."""

    # Admit a request only if its first token is predicted within this (the operator's TTFT objective).
    ttft_slo_s: float | None = None
    # Admit a request only if the mean step time over its first decodes is predicted within this.
    tpot_slo_s: float | None = None
    # Hard limits, whatever the prediction: requests waiting, predicted time before the first scheduled step.
    max_waiting: int | None = None
    max_queue_delay_s: float | None = None
    # Outputs a stream may hold undelivered before its request is aborted as a slow client.
    max_buffered_outputs: int = 256

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s", "max_queue_delay_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_buffered_outputs < 1:
            raise ValueError(f"max_buffered_outputs must be >= 1, got {self.max_buffered_outputs}")

    @property
    def limits_anything(self) -> bool:
        """Whether any limit is set (without one, admission refuses nothing)."""
        return any(
            limit is not None for limit in (self.ttft_slo_s, self.tpot_slo_s, self.max_waiting, self.max_queue_delay_s)
        )


class StepTimeModel:
    """Iteration time = c0 + c1 * prefill tokens + c2 * decodes, by ridge regression towards a prior with
    exponential forgetting (an observation's weight halves every ``half_life_steps`` iterations).

    The prior weighs two observations' worth; the engine's is its step costs measured at start-up
    (``EngineInfo.step_costs``). A prior that priced a decode as one prompt token at the prefill throughput, plus
    5 ms a step, predicted a one-decode step at 6 ms where it took 30 ms (float32): the first requests a fresh
    server admitted under overload missed the objective (5.3-5.7 s against 5 s at 5x capacity) before the steps
    had taught it. Coefficients are kept non-negative: a step never gets cheaper with more work.
    """

    # Typical magnitudes of the features, so the prior weighs each coefficient alike.
    _SCALE = np.array([1.0, 512.0, 32.0])

    def __init__(self, prior: tuple[float, float, float], half_life_steps: float = 200.0) -> None:
        self._prior = np.array(prior, dtype=float)
        self._prior_weight = np.diag(2.0 * self._SCALE**2)
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._coefficients = self._prior.copy()
        self.num_observations = 0

    def observe(self, num_prefill_tokens: int, num_decodes: int, duration_s: float) -> None:
        x = np.array([1.0, num_prefill_tokens, num_decodes])
        self._xtx = self._decay * self._xtx + np.outer(x, x)
        self._xty = self._decay * self._xty + x * duration_s
        solved = np.linalg.solve(self._xtx + self._prior_weight, self._xty + self._prior_weight @ self._prior)
        self._coefficients = np.maximum(solved, 0.0)
        self.num_observations += 1

    @classmethod
    def from_step_costs(cls, costs: StepCosts) -> StepTimeModel:
        return cls((costs.per_step_s, costs.per_prompt_token_s, costs.per_decode_s))

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return tuple(float(c) for c in self._coefficients)

    def predict(self, num_prefill_tokens: int, num_decodes: int) -> float:
        c0, c1, c2 = self._coefficients
        return float(c0 + c1 * num_prefill_tokens + c2 * num_decodes)


@dataclass(frozen=True)
class NewRequest:
    num_prompt_tokens: int
    max_tokens: int
    # The same for the same request sent again (a hash of its body): how a retry is recognised.
    retry_key: str | None = None
    # Its place in the scheduler's queues (``Request.place_in_line_ts``); infinity: behind every request there.
    place_in_line_ts: float = math.inf
    # Its prompt's full blocks (``PreparedRequest.block_hashes``): the forecast finds those cached as the engine will.
    block_hashes: tuple[BlockHash, ...] = ()

    @property
    def work(self) -> RemainingWork:
        return RemainingWork(
            self.num_prompt_tokens, 0, self.max_tokens, self.place_in_line_ts, block_hashes=self.block_hashes
        )


@dataclass(frozen=True)
class Decision:
    """``ttft_s`` and ``queue_s`` are the corrected central predictions; ``refusal`` is None when admitted;
    ``first_attempt_ts``: the request came back after the Retry-After it was given, and this is when it first
    asked (its place in line, ``Request.first_attempt_ts``); None for a new request."""

    ttft_s: float
    queue_s: float
    tpot_s: float | None
    refusal: AdmissionRefused | None
    first_attempt_ts: float | None = None

    @property
    def honoured_retry(self) -> bool:
        return self.first_attempt_ts is not None


class AdmissionController:
    """Decides on each new request from a forecast and learns from what the engine then delivers.

    Thread-safe: the engine thread reports steps and first tokens, the event loop asks for decisions.
    """

    # Ratios kept: at the rates where admission matters, about the last half minute of first tokens.
    WINDOW = 100
    # A new request must be predicted within this share of the TTFT objective; a request that comes back after
    # the Retry-After it was given takes its place in line from its first attempt and may use the whole objective.
    # The rest is room kept for retries: a retry goes ahead of the requests admitted since its first attempt, and
    # they still meet the objective. Under overload fresh arrivals alone keep the engine just as busy (the queue
    # never empties: goodput does not depend on how long it is).
    FRESH_SHARE = 0.85
    # How long after its Retry-After a refused request is still recognised as a retry; how many are remembered.
    PROMISE_GRACE_S = 30.0
    MAX_PROMISES = 10_000
    # Ratios needed before they replace the defaults (1.0 central, 1.25 margin); the share of the TTFT objective a
    # prediction must reach for its ratio to be kept.
    MIN_RATIOS = 10
    MIN_KEPT_SHARE = 0.1
    TAIL_QUANTILE = 0.95

    def __init__(self, limits: AdmissionLimits, info: EngineInfo) -> None:
        self.limits = limits
        self.info = info
        self.model = StepTimeModel.from_step_costs(info.step_costs)
        self._lock = threading.Lock()
        self._ratios: deque[float] = deque(maxlen=self.WINDOW)
        self._min_kept_prediction_s = 0.0 if limits.ttft_slo_s is None else self.MIN_KEPT_SHARE * limits.ttft_slo_s
        # Retry key -> when its Retry-After ends, when it first asked.
        self._promises: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def observe_iteration(self, step: StepStats, wall_s: float) -> None:
        """One loop iteration that ran a step: the model learns its wall time (step, deliveries, bookkeeping)."""
        if step.error is None:
            self.observe_step(step.num_prefill_tokens, step.num_batched_tokens - step.num_prefill_tokens, wall_s)

    def observe_step(self, num_prefill_tokens: int, num_decodes: int, wall_s: float) -> None:
        """A step that ran (did not fail), by its shape: what the simulator reports."""
        with self._lock:
            self.model.observe(num_prefill_tokens, num_decodes, wall_s)

    def observe_first_token(self, model_ttft_s: float, observed_ttft_s: float) -> None:
        """An admitted request's first token came ``observed_ttft_s`` after it arrived; the uncorrected model had
        predicted ``model_ttft_s``. A prediction under a tenth of the TTFT objective teaches the margin nothing:
        there a few steps' jitter is the whole prediction (0.16 s predicted, 0.40 s observed on a fresh server),
        and such ratios, kept for a window of requests, would hold the margin at twice what predictions near the
        objective need."""
        if 0 < model_ttft_s < math.inf and model_ttft_s >= self._min_kept_prediction_s:
            with self._lock:
                self._ratios.append(observed_ttft_s / model_ttft_s)

    def corrections(self) -> tuple[float, float]:
        """(central, tail): factors from the model's prediction to the median and the 95th percentile outcome."""
        with self._lock:
            ratios = list(self._ratios)
        if len(ratios) < self.MIN_RATIOS:
            return 1.0, 1.25
        central, tail = np.quantile(ratios, [0.5, self.TAIL_QUANTILE])
        return float(central), float(max(tail, central))

    def decide(
        self,
        snapshot: EngineSnapshot,
        elapsed_s: float,
        in_engine: Sequence[RemainingWork],
        arriving: Sequence[RemainingWork],
        new: NewRequest,
        now: float | None = None,
        siblings: Sequence[NewRequest] = (),
    ) -> tuple[Decision, float]:
        """The decision for ``new`` and the uncorrected model's TTFT (what ``observe_first_token`` wants back);
        the arguments are ``forecast``'s, and ``now`` the monotonic clock (Retry-After promises).

        ``siblings``: the other sequences of ``new``'s request (its other prompts and choices), decided with it,
        all or none. They join the queue just ahead of it, so each counts against the limits as a request does and
        the prediction is the one for the request's last sequence: ``n`` choices wait and slow the others as ``n``
        requests would, and are refused as they would be."""
        limits = self.limits
        now = time.monotonic() if now is None else now
        first_attempt_ts = self._claim_promise(new.retry_key, now)
        honoured_retry = first_attempt_ts is not None
        if honoured_retry:
            new = dataclasses.replace(new, place_in_line_ts=first_attempt_ts)
            siblings = [dataclasses.replace(sibling, place_in_line_ts=first_attempt_ts) for sibling in siblings]
        arriving = [*arriving, *(sibling.work for sibling in siblings)]
        stats = snapshot.stats
        # Decodes after the first token matter only to a TPOT objective; a forecast without them ends sooner.
        tpot_decodes = 0 if limits.tpot_slo_s is None else TPOT_DECODES
        with self._lock:
            predicted = forecast(
                snapshot,
                self.info,
                in_engine,
                arriving,
                new.work,
                self.model.predict,
                elapsed_s,
                tpot_decodes=tpot_decodes,
            )
        central, tail = self.corrections()
        ttft_s, queue_s, tail_ttft_s = predicted.ttft_s * central, predicted.queue_s * central, predicted.ttft_s * tail
        num_waiting = stats.num_waiting + len(in_engine) + len(arriving)
        refusal = None
        if limits.max_waiting is not None and num_waiting >= limits.max_waiting:
            with_siblings = f", {len(siblings)} of them this request's other sequences" if siblings else ""
            message = f"{num_waiting} requests are waiting{with_siblings} (limit {limits.max_waiting})"
            refusal = _refusal("max_waiting", message, queue_s)
        elif limits.max_queue_delay_s is not None and queue_s > limits.max_queue_delay_s:
            message = f"predicted queue time {_seconds(queue_s)} exceeds the limit of {limits.max_queue_delay_s:g} s"
            refusal = _refusal("max_queue_delay", message, queue_s - limits.max_queue_delay_s)
        elif limits.ttft_slo_s is not None and tail_ttft_s > limits.ttft_slo_s * (
            1.0 if honoured_retry else self.FRESH_SHARE
        ):
            share = "" if honoured_retry else f"{self.FRESH_SHARE:.0%} of "
            message = (
                f"this request would likely wait longer for its first token than the server promises (predicted "
                f"{_seconds(ttft_s)}, 95th percentile {_seconds(tail_ttft_s)}, against {share}the objective of "
                f"{limits.ttft_slo_s:g} s"
                + ("" if honoured_retry else "; the rest is room kept for requests that come back after a 429")
                + ")"
            )
            # When it would fit the whole objective from this place in line: the excess drains at the predicted pace.
            refusal = _refusal("ttft_slo", message, tail_ttft_s - limits.ttft_slo_s)
            first_asked = now if first_attempt_ts is None else first_attempt_ts
            self._promise(new.retry_key, now + refusal.retry_after_s, first_asked)
        elif limits.tpot_slo_s is not None and predicted.tpot_s is not None and predicted.tpot_s > limits.tpot_slo_s:
            message = (
                f"predicted time per output token {predicted.tpot_s * 1e3:.0f} ms exceeds the objective of "
                f"{limits.tpot_slo_s * 1e3:g} ms"
            )
            refusal = _refusal("tpot_slo", message, queue_s)
        decision = Decision(ttft_s, queue_s, predicted.tpot_s, refusal, first_attempt_ts)
        return decision, predicted.ttft_s

    def _claim_promise(self, retry_key: str | None, now: float) -> float | None:
        """When ``retry_key`` first asked, if it was refused and comes back after its Retry-After (the promise is
        used); None otherwise."""
        with self._lock:
            promise = self._promises.get(retry_key) if retry_key is not None else None
            if promise is None:
                return None
            due, first_attempt_ts = promise
            if now < due - 0.5 or now > due + self.PROMISE_GRACE_S:
                return None
            del self._promises[retry_key]
            return first_attempt_ts

    def _promise(self, retry_key: str | None, due: float, first_attempt_ts: float) -> None:
        if retry_key is None:
            return
        with self._lock:
            self._promises[retry_key] = (due, first_attempt_ts)
            self._promises.move_to_end(retry_key)
            while len(self._promises) > self.MAX_PROMISES:
                self._promises.popitem(last=False)

    def ttft_limit_s(self) -> float | None:
        """The uncorrected model's TTFT under which a new request is admitted now: its share of the objective over
        the margin."""
        if self.limits.ttft_slo_s is None:
            return None
        return self.limits.ttft_slo_s * self.FRESH_SHARE / self.corrections()[1]


def _refusal(reason: str, message: str, excess_s: float) -> AdmissionRefused:
    """Retry-After: the whole seconds until the excess over the limit has drained at the predicted pace (at least
    1; the forecast's horizon when the forecast did not reach the request)."""
    retry_after_s = max(1, math.ceil(excess_s)) if math.isfinite(excess_s) else int(FORECAST_HORIZON_S)
    return AdmissionRefused(f"server busy: {message}; retry after {retry_after_s} s", reason, retry_after_s)


def _seconds(value_s: float) -> str:
    return f"{value_s:.1f} s" if math.isfinite(value_s) else f"over {FORECAST_HORIZON_S:g} s"
