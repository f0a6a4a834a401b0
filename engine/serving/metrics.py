"""Prometheus metrics of the engine and server, under vLLM's names (plus ``kvstorm:`` series).

The engine produces plain data (``StepStats``, ``SchedulerStats``, ``PreemptionEvent``,
``Request`` timestamps); this module is the only one that knows Prometheus. Each
``EngineMetrics`` owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from engine.core.config import PreemptionMode
from engine.core.outputs import EngineSnapshot, FinishReason, RequestTimings, SchedulerStats, StepStats

# The latency thresholds the default SLOs use (seconds). Each must be a bucket boundary: a
# quantile or "fraction under X" can only be read from a histogram at an existing `le`.
DEFAULT_SLO_THRESHOLDS_S = {
    "time_to_first_token": (0.2, 0.5, 1.0, 2.0, 5.0),
    "inter_token_latency": (0.025, 0.05, 0.1, 0.2, 0.5),
    "e2e_request_latency": (5.0, 10.0, 30.0, 60.0),
    "request_queue_time": (0.5, 1.0, 5.0),
}
# 1 ms (a GPU decode step) to 10 minutes (a long CPU generation under preemption), roughly 1-2-5 steps.
BASE_LATENCY_BUCKETS_S = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)  # fmt: skip
PREEMPTIONS_PER_REQUEST_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Around 1: within 10%, 20% and 25% either way are bucket boundaries.
# An admission decision (its forecast) takes from tens of microseconds on an idle engine to tens of milliseconds with
# hundreds of requests in flight, each on the server's event loop.
DECISION_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.8, 0.9, 1.0, 1.1, 1.2, 1.25, 1.5, 2.0, 4.0)
ABORT_PHASES = ("queued", "prefill", "decode", "swapped")
# "client": the client went away or cancelled; "slow_client": it left too many outputs unread (back-pressure).
ABORT_REASONS = ("client", "slow_client")
FINISH_REASONS = ("stop", "length", "abort", "error")


def latency_buckets(extra_s: Iterable[float] = ()) -> tuple[float, ...]:
    """The base buckets, every default SLO threshold and ``extra_s``, sorted and deduplicated."""
    thresholds = [t for values in DEFAULT_SLO_THRESHOLDS_S.values() for t in values]
    return tuple(sorted({*BASE_LATENCY_BUCKETS_S, *thresholds, *extra_s}))


class EngineMetrics:
    """Every series the server exports. Thread-safe (prometheus_client is); called from the engine thread."""

    def __init__(self, model_name: str, extra_buckets_s: Iterable[float] = ()) -> None:
        # No `*_created` series (as vLLM does): they double the exposition and no dashboard reads them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._latency_buckets = latency_buckets(extra_buckets_s)
        # In the order they are exposed.
        self._add_queue_and_kv_series()
        self._add_event_series()
        self._add_latency_series()
        self._add_admission_series()
        self._add_request_series()
        self._start_series_at_zero()

    # A series labelled by the model alone is bound once here: the engine thread updates several per token.
    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(model_name=self.model_name)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(model_name=self.model_name)

    def _histogram(self, name: str, doc: str, bucket_bounds: Iterable[float] | None = None):
        buckets = tuple(self._latency_buckets if bucket_bounds is None else bucket_bounds)
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(
            model_name=self.model_name
        )

    def _labelled(self, kind, name: str, doc: str, extra: tuple[str, ...]):
        """A family with more labels than the model: children are picked per event with ``_labels``."""
        return kind(name, doc, ["model_name", *extra], registry=self.registry)

    def _add_queue_and_kv_series(self) -> None:
        self.num_requests_running = self._gauge("vllm:num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.num_requests_swapped = self._gauge("vllm:num_requests_swapped", "Requests swapped out to host memory")
        self.kv_cache_usage = self._gauge("vllm:kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1)")
        self.cpu_cache_usage = self._gauge("vllm:cpu_cache_usage_perc", "Fraction of host swap blocks in use (0-1)")
        self.free_blocks = self._labelled(Gauge, "kvstorm:free_blocks", "Free KV blocks per pool", ("pool",))
        self.total_blocks = self._labelled(
            Gauge, "kvstorm:total_blocks", "KV blocks per pool that may be in use (less under a cap fault)", ("pool",)
        )
        self.kv_cap_fraction = self._labelled(
            Gauge, "kvstorm:kv_cap_fraction", "Fraction of each pool's blocks usable now (1: no cap fault)", ("pool",)
        )
        self.cpu_threads = self._gauge(
            "kvstorm:cpu_threads", "CPU threads the engine's steps run on (fewer while other processes take a core)"
        )
        self.cpu_co_tenant_cores = self._gauge(
            "kvstorm:cpu_co_tenant_cores",
            "Cores' worth of the engine's CPUs other processes used over the last quarter-second read (steal included)",
        )
        # vLLM's names and units (tokens), so a dashboard's hit rate reads either server.
        self.prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens"
        )
        self.prefix_cache_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens"
        )
        self.prompt_tokens_cached = self._counter(
            "vllm:prompt_tokens_cached", "Prompt tokens found in the prefix cache at a request's first admission"
        )
        self.prefix_cache_evictions = self._counter(
            "kvstorm:prefix_cache_evictions", "Cached KV blocks evicted (to make room, or by a KV cap)"
        )
        self.cached_blocks = self._labelled(
            Gauge,
            "kvstorm:prefix_cache_blocks",
            "Device blocks cached under a prefix hash: held by requests, or evictable (counted as free)",
            ("state",),
        )
        self._prefix_cache_totals = (0, 0, 0)

    def _add_event_series(self) -> None:
        self.num_preemptions = self._counter("vllm:num_preemptions", "Preemptions (vLLM's name)")
        self.preemptions = self._labelled(
            Counter, "kvstorm:preemptions", "Preemptions by mode and reason", ("mode", "reason")
        )
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens")
        self.request_success = self._labelled(
            Counter, "vllm:request_success", "Finished requests by finish reason", ("finished_reason",)
        )
        self.aborted_requests = self._labelled(
            Counter, "kvstorm:aborted_requests", "Aborted requests by the phase they hit and why", ("phase", "reason")
        )
        self.rejected_requests = self._labelled(
            Counter, "kvstorm:rejected_requests", "Requests refused before start", ("reason",)
        )
        self.recomputed_tokens = self._counter(
            "kvstorm:recomputed_tokens", "Computed tokens thrown away by recompute preemptions (computed again later)"
        )
        self.swap_blocks = self._labelled(
            Counter, "kvstorm:swap_blocks", "KV blocks moved between pools", ("direction",)
        )
        self.swap_bytes = self._labelled(Counter, "kvstorm:swap_bytes", "KV bytes moved between pools", ("direction",))
        self.active_faults = self._labelled(Gauge, "kvstorm:active_faults", "Faults active now (1) by name", ("fault",))
        self.failed_steps = self._labelled(
            Counter, "kvstorm:failed_steps", "Steps whose forward pass raised (the engine backs off)", ("error",)
        )
        self.batch_limit = self._labelled(
            Gauge, "kvstorm:batch_limit", "Requests and tokens a step may take now (less while backing off)", ("of",)
        )

    def _add_latency_series(self) -> None:
        self.time_to_first_token = self._histogram("vllm:time_to_first_token_seconds", "Arrival to first token")
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Gap between tokens of a request"
        )
        self.e2e_request_latency = self._histogram("vllm:e2e_request_latency_seconds", "Arrival to finish")
        self.request_queue_time = self._histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled")
        self.step_duration = self._histogram("kvstorm:step_duration_seconds", "Duration of one engine step")
        self.swap_latency = self._histogram("kvstorm:swap_latency_seconds", "Block moves of one step that swapped")
        self.batch_tokens = self._histogram("kvstorm:batch_tokens", "Tokens in one step's batch", BATCH_TOKEN_BUCKETS)

    def _add_admission_series(self) -> None:
        self.admitted_requests = self._counter(
            "kvstorm:admitted_requests", "Requests admission control let in (refusals: kvstorm:rejected_requests)"
        )
        self.retries = self._labelled(
            Counter,
            "kvstorm:admission_retries",
            "Requests that came back after their Retry-After, by whether they were admitted then",
            ("outcome",),
        )
        self.predicted_ttft = self._histogram(
            "kvstorm:admission_predicted_ttft_seconds",
            "Time to first token admission predicted for each admitted request",
        )
        self.admission_decision = self._histogram(
            "kvstorm:admission_decision_seconds",
            "Time admission control took to decide on a request (its forecast), on the server's event loop",
            DECISION_BUCKETS,
        )
        self.ttft_prediction_ratio = self._histogram(
            "kvstorm:admission_ttft_prediction_ratio",
            "Predicted over observed time to first token of each admitted request (1: exact)",
            PREDICTION_RATIO_BUCKETS,
        )
        self.ttft_objective = self._labelled(
            Gauge,
            "kvstorm:admission_ttft_objective_seconds",
            "The time to first token the server promises its admitted requests (--ttft-slo), at the quantile it "
            "promises it (admission admits where the 95th percentile of its prediction is within it); absent "
            "without an objective",
            ("quantile",),
        )
        self.admission_ttft_limit = self._gauge(
            "kvstorm:admission_ttft_limit_seconds",
            "The service model's time to first token under which a request is admitted now (the TTFT objective over "
            "the learnt margin; absent without an objective)",
        )
        self.admission_correction = self._labelled(
            Gauge,
            "kvstorm:admission_correction",
            "Observed over the service model's time to first token, median and 95th percentile of recent requests",
            ("quantile",),
        )

    def _add_request_series(self) -> None:
        # vLLM's name and labels: a harness reads one server's KV size the same way as the other's (chaos.run.sizing).
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "KV cache configuration (the labels; the value is 1)",
            ["block_size", "num_gpu_blocks", "num_cpu_blocks", "kv_cache_size_tokens"],
            registry=self.registry,
        )
        self.request_preemptions = self._histogram(
            "kvstorm:request_preemptions", "Preemptions a request went through", PREEMPTIONS_PER_REQUEST_BUCKETS
        )

    def _start_series_at_zero(self) -> None:
        """Series that exist from the start, at 0, so rate() and absent() work before the first event."""
        for reason in FINISH_REASONS:
            self._labels(self.request_success, finished_reason=reason)
        for outcome in ("admitted", "refused"):
            self._labels(self.retries, outcome=outcome)
        for phase in ABORT_PHASES:
            for reason in ABORT_REASONS:
                self._labels(self.aborted_requests, phase=phase, reason=reason)

    def _labels(self, metric, **extra: str):
        return metric.labels(model_name=self.model_name, **extra)

    def observe_step(self, step: StepStats, bytes_per_block: int) -> None:
        if step.error is not None:
            self._labels(self.failed_steps, error=step.error).inc()
        self.step_duration.observe(step.duration_s)
        self.batch_tokens.observe(step.num_batched_tokens)
        for direction, num_blocks in (("in", step.num_swapped_in_blocks), ("out", step.num_swapped_out_blocks)):
            self._labels(self.swap_blocks, direction=direction).inc(num_blocks)
            self._labels(self.swap_bytes, direction=direction).inc(num_blocks * bytes_per_block)
        if step.num_swapped_in_blocks or step.num_swapped_out_blocks:
            self.swap_latency.observe(step.swap_s)
        for event in step.preemptions:
            self.num_preemptions.inc()
            self._labels(self.preemptions, mode=event.mode.value, reason=event.reason).inc()
            if event.mode is PreemptionMode.RECOMPUTE:
                self.recomputed_tokens.inc(event.num_computed_tokens)

    def observe_cache_config(self, block_size: int, num_device_blocks: int, num_host_blocks: int) -> None:
        """The physical pools: a cap fault lowers ``kvstorm:total_blocks``, not the cache the server was given."""
        self.cache_config_info.labels(
            block_size=str(block_size),
            num_gpu_blocks=str(num_device_blocks),
            num_cpu_blocks=str(num_host_blocks),
            kv_cache_size_tokens=str(num_device_blocks * block_size),
        ).set(1)

    def observe_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_snapshot(self, snapshot: EngineSnapshot) -> None:
        """The engine between two steps: its queues, pools, prefix cache, batch limit and faults."""
        self._observe_queues(snapshot.stats)
        self._observe_prefix_cache(snapshot.stats)
        share = snapshot.cpu_share
        if share is not None:
            self.cpu_threads.set(share.threads)
            if share.co_tenant_cores is not None:
                self.cpu_co_tenant_cores.set(share.co_tenant_cores)
        for fault, active in snapshot.active_faults.items():
            self.set_fault(fault, active)

    def _observe_prefix_cache(self, stats: SchedulerStats) -> None:
        """The engine counts since it started; the counters go up by what it counted since the last snapshot."""
        totals = (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens, stats.prefix_cache_evictions)
        for counter, total, before in zip(
            (self.prefix_cache_queries, self.prefix_cache_hits, self.prefix_cache_evictions),
            totals,
            self._prefix_cache_totals,
            strict=True,
        ):
            if total > before:
                counter.inc(total - before)
        self._prefix_cache_totals = totals
        held = stats.num_cached_device_blocks - stats.num_evictable_device_blocks
        self._labels(self.cached_blocks, state="held").set(held)
        self._labels(self.cached_blocks, state="evictable").set(stats.num_evictable_device_blocks)

    def _observe_queues(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        for pool, free, total, physical in (
            ("device", stats.num_free_device_blocks, stats.num_device_blocks, stats.num_physical_device_blocks),
            ("host", stats.num_free_host_blocks, stats.num_host_blocks, stats.num_physical_host_blocks),
        ):
            self._labels(self.free_blocks, pool=pool).set(free)
            self._labels(self.total_blocks, pool=pool).set(total)
            self._labels(self.kv_cap_fraction, pool=pool).set(total / physical if physical else 1.0)
        self._labels(self.batch_limit, of="requests").set(stats.max_num_seqs_now)
        self._labels(self.batch_limit, of="tokens").set(stats.max_num_batched_tokens_now)
        self.kv_cache_usage.set(_usage(stats.num_free_device_blocks, stats.num_device_blocks))
        self.cpu_cache_usage.set(_usage(stats.num_free_host_blocks, stats.num_host_blocks))

    def observe_tokens(
        self, timings: RequestTimings, num_new_tokens: int, gap_s: float | None, num_cached_tokens: int | None = None
    ) -> None:
        """New tokens of one request; ``gap_s`` is the time since its previous token (None for the first, which
        also counts the prompt tokens it found cached)."""
        self.generation_tokens.inc(num_new_tokens)
        if gap_s is None:
            self.time_to_first_token.observe(timings.first_token_ts - timings.arrival_ts)
            self.prompt_tokens_cached.inc(num_cached_tokens or 0)
        else:
            self.inter_token_latency.observe(gap_s)

    def observe_finished(self, timings: RequestTimings, finish_reason: FinishReason) -> None:
        """A request ended; without a finish time in ``timings`` (an engine that could not say), it ends now."""
        self._labels(self.request_success, finished_reason=finish_reason).inc()
        finished_ts = time.monotonic() if timings.finished_ts is None else timings.finished_ts
        self.e2e_request_latency.observe(finished_ts - timings.arrival_ts)
        if timings.first_scheduled_ts is not None:
            self.request_queue_time.observe(timings.first_scheduled_ts - timings.arrival_ts)
        self.request_preemptions.observe(timings.num_preemptions)

    def observe_abort(self, phase: str, reason: str) -> None:
        self._labels(self.aborted_requests, phase=phase, reason=reason).inc()

    def observe_rejected(self, reason: str) -> None:
        self._labels(self.rejected_requests, reason=reason).inc()

    def observe_admission_decision(self, seconds: float) -> None:
        self.admission_decision.observe(seconds)

    def observe_admitted(self, predicted_ttft_s: float) -> None:
        self.admitted_requests.inc()
        self.predicted_ttft.observe(predicted_ttft_s)

    def observe_retry(self, admitted: bool) -> None:
        self._labels(self.retries, outcome="admitted" if admitted else "refused").inc()

    def observe_first_token_prediction(self, predicted_s: float, observed_s: float) -> None:
        if observed_s > 0:
            self.ttft_prediction_ratio.observe(predicted_s / observed_s)

    def observe_ttft_objective(self, objective_s: float | None, quantile: float) -> None:
        if objective_s is not None:
            self._labels(self.ttft_objective, quantile=f"{quantile:g}").set(objective_s)

    def observe_admission_limit(self, ttft_limit_s: float | None, central: float, tail: float) -> None:
        if ttft_limit_s is not None:
            self.admission_ttft_limit.set(ttft_limit_s)
        self._labels(self.admission_correction, quantile="0.5").set(central)
        self._labels(self.admission_correction, quantile="0.95").set(tail)

    def set_fault(self, fault: str, active: bool) -> None:
        self._labels(self.active_faults, fault=fault).set(1 if active else 0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _usage(num_free: int, num_total: int) -> float:
    return (num_total - num_free) / num_total if num_total else 0.0
