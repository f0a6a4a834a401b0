"""The controller's own Prometheus series (``kvstorm_chaos_*``), fed by the events of its runs and its ad-hoc faults.

- ``kvstorm_chaos_fault_active{fault,target}``: 1 while a fault is on (a Grafana annotation or state timeline query);
- ``kvstorm_chaos_fault_window_seconds{run,fault,edge}``: start and end (unix seconds) of each fault window of the
  runs that finished, so a dashboard can draw them after the fact;
- ``kvstorm_chaos_runs_total{experiment,result}``, ``kvstorm_chaos_run_phase{phase}`` (1 for the current one);
- the load generator's client-side view of the current run: ``kvstorm_chaos_client_requests_total{outcome}``,
  ``kvstorm_chaos_client_in_flight``, and the ``kvstorm_chaos_client_time_to_first_token_seconds`` and
  ``..._inter_token_latency_seconds`` histograms, with the target's own bucket boundaries when its ``/metrics``
  has vLLM's histograms (so the client's and the server's percentiles read alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from chaos.run.metrics import MetricsSample, scrape

PHASES = ("steady state before", "method", "steady state after", "rollbacks")
# Used when the target exposes no vLLM histograms to copy (1 ms to 10 min, roughly 1-2-5).
FALLBACK_BUCKETS_S = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    60.0,
    120.0,
    600.0,
)


def target_buckets(target_url: str, histogram: str) -> tuple[float, ...]:
    """The ``le`` boundaries of one of the target's histograms; the fallback when it has none or is down."""
    try:
        sample: MetricsSample = scrape(target_url)
    except Exception:
        return FALLBACK_BUCKETS_S
    bounds = {float(dict(labels)["le"]) for labels in sample.values.get(f"{histogram}_bucket", {})}
    finite = tuple(sorted(b for b in bounds if b != float("inf")))
    return finite or FALLBACK_BUCKETS_S


class ControllerMetrics:
    def __init__(self, target_url: str) -> None:
        self.registry = CollectorRegistry()
        self.target_url = target_url
        r = self.registry
        self.fault_active = Gauge(
            "kvstorm_chaos_fault_active", "1 while a fault is on", ["fault", "target"], registry=r
        )
        self.fault_window = Gauge(
            "kvstorm_chaos_fault_window_seconds",
            "Start and end (unix seconds) of each fault window of the finished runs",
            ["run", "fault", "edge"],
            registry=r,
        )
        self.runs = Counter(
            "kvstorm_chaos_runs", "Experiment runs by their result", ["experiment", "result"], registry=r
        )
        self.phase = Gauge("kvstorm_chaos_run_phase", "1 for the current run's phase", ["phase"], registry=r)
        self.requests = Counter(
            "kvstorm_chaos_client_requests",
            "The current run's requests by outcome (client side)",
            ["outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvstorm_chaos_client_in_flight", "Requests sent and not ended (client side)", registry=r
        )
        self.ttft = Histogram(
            "kvstorm_chaos_client_time_to_first_token_seconds",
            "Time to first token measured by the client",
            buckets=target_buckets(target_url, "vllm:time_to_first_token_seconds"),
            registry=r,
        )
        self.itl = Histogram(
            "kvstorm_chaos_client_inter_token_latency_seconds",
            "Gaps between tokens measured by the client",
            buckets=target_buckets(target_url, "vllm:inter_token_latency_seconds"),
            registry=r,
        )
        for phase in PHASES:
            self.phase.labels(phase=phase).set(0)
        self._faults_seen: set[str] = set()

    def observe(self, run_id: str, experiment: str, event: dict[str, Any]) -> None:
        """One event of a run (``chaos.run.state.RunState.emit``)."""
        kind = event["type"]
        if kind == "fault":
            self.set_fault(event["name"], event["active"])
        elif kind == "phase":
            for phase in PHASES:
                self.phase.labels(phase=phase).set(1 if event["phase"] == phase else 0)
        elif kind == "load":
            self.in_flight.set(event["num_sent"] - event["num_finished"])
        elif kind == "request":
            self.requests.labels(outcome=event["outcome"]).inc()
            if event["ttft_s"] is not None:
                self.ttft.observe(event["ttft_s"])
            for gap_s in event["itl_s"]:
                self.itl.observe(gap_s)
        elif kind == "verdict":
            self.finish(run_id, experiment, event["status"], event["fault_windows"])

    def finish(self, run_id: str, experiment: str, result: str, windows: Sequence[dict[str, Any]] = ()) -> None:
        self.runs.labels(experiment=experiment, result=result).inc()
        for phase in PHASES:
            self.phase.labels(phase=phase).set(0)
        self.in_flight.set(0)
        for window in windows:
            for edge in ("start", "end"):
                self.fault_window.labels(run=run_id, fault=window["name"], edge=edge).set(window[f"{edge}_unix"])

    def set_fault(self, fault: str, active: bool) -> None:
        self._faults_seen.add(fault)
        self.fault_active.labels(fault=fault, target=self.target_url).set(1 if active else 0)

    def clear_faults(self) -> None:
        for fault in self._faults_seen:
            self.fault_active.labels(fault=fault, target=self.target_url).set(0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
