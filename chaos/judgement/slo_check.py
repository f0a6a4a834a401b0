"""The SLO spec of the dashboards and alerts (``dashboards.slo``) judged over one load: the same counters and
histogram buckets, the same thresholds, read from the server's ``/metrics`` (scraped before, every second during
and after the load) instead of from Prometheus, so a verdict and the SLO dashboard over the same minutes cannot
disagree.

An events SLO's SLI is the good fraction of the events during the load (the counters' increase, counted as
Prometheus' ``increase()`` does, across restarts); its burn rate is the bad fraction over the error budget, the
number the burn-rate alerts compare with 14.4 and 6. A guardrail on a counter reads its rate over the load; one on a
gauge (KV usage) is crossed when the gauge stays above its threshold as long as its alert waits (``for``).

The spec is the run's profile with a user's overrides (``kvstorm chaos run --slo-profile --slo-file``, or
``$KVSTORM_SLO_PROFILE`` and ``$KVSTORM_SLO_FILE``, also for the stock ``chaos run``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from chaos.run.metrics import MetricsSample, counter_increase
from chaos.run.state import LoadRun, current
from dashboards.slo import GUARDRAIL_FOR_S, Scrape, Slo, bucket_bounds, load_spec


def run_spec() -> tuple[Slo, ...]:
    """The SLOs the current run is judged by."""
    state = current()
    return load_spec(state.slo_profile, state.slo_file)


@dataclass(frozen=True)
class SloResult:
    slo: Slo
    # events: the good fraction; guardrail: the value. None: no event, or the server does not expose the metric.
    value: float | None
    good: float = 0.0
    total: float = 0.0
    exposed: bool = True
    # A gauge's guardrail: seconds it spent above the threshold.
    seconds_over: float | None = None
    # Why it could not be measured, when not exposed.
    why_unmeasured: str = "its series are not exported"

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        if self.slo.kind == "events":
            return self.value >= self.slo.objective
        if self.seconds_over is not None:
            return self.seconds_over < GUARDRAIL_FOR_S
        return self.value <= self.slo.threshold

    @property
    def burn_rate(self) -> float | None:
        """How many times faster than the objective allows the load spent the error budget (events SLOs)."""
        if self.slo.kind != "events" or self.value is None:
            return None
        return (1 - self.value) / self.slo.error_budget


def evaluate(slo: Slo, load: LoadRun) -> SloResult:
    if load.metrics_before is None or load.metrics_after is None:
        raise RuntimeError(f"load {load.name!r} has no scrapes from before and after it")
    scrapes = [load.metrics_before, *load.samples, load.metrics_after]
    if not load.metrics_after.has(slo.metrics()[0]):
        return SloResult(slo, None, exposed=False)
    if slo.histogram is not None and slo.threshold not in bucket_bounds(load.metrics_after.values, slo.histogram):
        # Counted from a bucket that is not there, every event would be bad: the threshold cannot be read.
        why = f"the server has no {slo.histogram} bucket at {slo.threshold:g} s"
        return SloResult(slo, None, exposed=False, why_unmeasured=why)
    if slo.kind == "events":
        good, total = increase(slo.good.count, scrapes), increase(slo.total.count, scrapes)
        return SloResult(slo, good / total if total > 0 else None, good, total)
    if slo.rate_of is not None:
        seconds = scrapes[-1].unix_s - scrapes[0].unix_s
        return SloResult(slo, increase(slo.rate_of.count, scrapes) / max(seconds, 1e-9))
    values = [max(scrape.values.get(slo.gauge, {}).values(), default=0.0) for scrape in scrapes]
    seconds_over = sum(
        later.unix_s - earlier.unix_s
        for (earlier, value), (later, _) in pairwise(zip(scrapes, values, strict=True))
        if value > slo.threshold
    )
    return SloResult(slo, max(values), seconds_over=seconds_over)


def evaluate_all(slos: Sequence[Slo], load: LoadRun) -> list[SloResult]:
    return [evaluate(slo, load) for slo in slos]


def increase(count: Callable[[Scrape], float], scrapes: Sequence[MetricsSample]) -> float:
    """A counter's increase over consecutive scrapes, in time order (``counter_increase``)."""
    return counter_increase([count(sample.values) for sample in sorted(scrapes, key=lambda sample: sample.unix_s)])
