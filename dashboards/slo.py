"""One SLO spec for the dashboards, the Prometheus rules and their alerts: each SLO's SLI as PromQL over vLLM's
metric names (so it works on vLLM as on kvstorm), a threshold and an objective.

Two kinds:

- ``events``: the fraction of good events over a window must stay at or above ``objective`` (99% of requests
  with TTFT <= 5 s over 30 days). The SLI is ``good / total``; what is left of ``1 - objective`` is the error
  budget, and the burn-rate alerts watch how fast it goes. A latency SLO counts a request as good when the
  histogram puts it at or under ``threshold`` seconds, so ``threshold`` must be a bucket boundary of that
  histogram (the tests check it against a live ``/metrics``).
- ``guardrail``: an instant value that must stay within ``threshold`` (preemptions per second, swap-out rate, KV
  usage); no budget, an alert when it is crossed for a while.

Profiles: ``cpu`` (the bundled 135M model on 2 cores) and ``h200`` (an 8B model on one H200). A user's YAML file
overrides thresholds and objectives per SLO by name (``load_spec``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

# The SLO windows of the burn-rate alerts (Google's SRE workbook: page on 1h/5m at 14.4x and 6h/30m at 6x, ticket
# on 3d/6h at 1x) and the error-budget window.
RATE_WINDOWS = ("5m", "30m", "1h", "6h", "3d")
BUDGET_WINDOW = "30d"
# One scrape of /metrics: sample name (with _total, _bucket...) -> label set -> value.
Scrape = Mapping[str, Mapping[frozenset[tuple[str, str]], float]]
MODEL = "model_name"  # the label every engine series carries; SLIs are per model


@dataclass(frozen=True)
class Counter:
    """The series of one counter whose ``label`` has one of ``values`` (all of its series without a label)."""

    metric: str
    label: str | None = None
    values: tuple[str, ...] = ()

    def selector(self) -> str:
        if self.label is None:
            return self.metric
        if len(self.values) == 1:
            return f'{self.metric}{{{self.label}="{self.values[0]}"}}'
        return f'{self.metric}{{{self.label}=~"{"|".join(self.values)}"}}'

    def rate(self, window: str) -> str:
        return f"sum by ({MODEL}) (rate({self.selector()}[{window}]))"

    def count(self, scrape: Scrape) -> float:
        """The sum of the matching series in one scrape."""
        return sum(
            value
            for labels, value in scrape.get(self.metric, {}).items()
            if self.label is None or dict(labels).get(self.label) in self.values
        )


@dataclass(frozen=True)
class Events:
    """A count of events as a signed sum of counters: ``plus`` minus ``minus``."""

    plus: tuple[Counter, ...]
    minus: tuple[Counter, ...] = ()

    def rate(self, window: str) -> str:
        """PromQL for the events per second over ``window``. A term that a server does not expose (vLLM has no
        ``kvstorm:rejected_requests_total``; no request may have failed yet) counts 0 rather than emptying the sum."""
        first, *others = [counter.rate(window) for counter in self.plus]
        zero = f"{first} * 0"
        expr = first + "".join(f" + ({term} or {zero})" for term in others)
        return expr + "".join(f" - ({counter.rate(window)} or {zero})" for counter in self.minus)

    def counters(self) -> tuple[Counter, ...]:
        return self.plus + self.minus

    def count(self, scrape: Scrape) -> float:
        """The events counted in one scrape."""
        return sum(c.count(scrape) for c in self.plus) - sum(c.count(scrape) for c in self.minus)


@dataclass(frozen=True)
class Slo:
    name: str
    title: str
    kind: str  # events or guardrail
    threshold: float
    unit: str  # Grafana unit of the threshold and of the SLI's raw value: s, percentunit, ops...
    description: str
    objective: float | None = None  # events only
    # events: the good and all events; the SLI is good / total over a window.
    good: Events | None = None
    total: Events | None = None
    # guardrail: a counter's rate over GUARDRAIL_WINDOW, or a gauge's highest value.
    rate_of: Counter | None = None
    gauge: str | None = None
    # The histogram a latency SLO reads (threshold must be one of its bucket boundaries), and what it times.
    histogram: str | None = None
    event: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("events", "guardrail"):
            raise ValueError(f"SLO {self.name}: kind must be events or guardrail, got {self.kind!r}")
        if self.kind == "events" and not (self.objective is not None and 0 < self.objective < 1):
            raise ValueError(f"SLO {self.name}: an events SLO needs an objective in (0, 1), got {self.objective!r}")
        if (self.kind == "events") != (self.good is not None and self.total is not None):
            raise ValueError(f"SLO {self.name}: good and total events belong to (and only to) an events SLO")
        if self.kind == "guardrail" and (self.rate_of is None) == (self.gauge is None):
            raise ValueError(f"SLO {self.name}: a guardrail reads either a counter's rate or a gauge")

    @property
    def error_budget(self) -> float:
        return 1 - self.objective

    def error_ratio(self, window: str) -> str:
        """The fraction of bad events over ``window``: 1 - good/total, 0 while there is no event."""
        good, total = self.good.rate(window), self.total.rate(window)
        return f"(1 - ({good}) / ({total})) or ({total}) * 0"

    def recorded_error_ratio(self, window: str) -> str:
        """The name of the recording rule that holds ``error_ratio(window)``."""
        return f"{MODEL}:slo_{self.name}_errors:ratio_rate{window}"

    @property
    def value(self) -> str:
        """A guardrail's PromQL."""
        if self.rate_of is not None:
            return self.rate_of.rate(GUARDRAIL_WINDOW)
        return f"max by ({MODEL}) ({self.gauge})"

    def metrics(self) -> tuple[str, ...]:
        """The metric names (as exposed, with suffixes) this SLO reads."""
        if self.kind == "events":
            return tuple(dict.fromkeys(c.metric for c in self.good.counters() + self.total.counters()))
        return (self.rate_of.metric,) if self.rate_of is not None else (self.gauge,)


def latency(name: str, title: str, histogram: str, threshold_s: float, objective: float, event: str) -> Slo:
    """An events SLO on a latency histogram: a request is good when its ``event`` took at most ``threshold_s``."""
    return Slo(
        name=name,
        title=title,
        kind="events",
        threshold=threshold_s,
        objective=objective,
        unit="s",
        description=f"{objective:.2%} of requests with {event} at most {threshold_s:g} s",
        good=Events((Counter(f"{histogram}_bucket", "le", (_le(threshold_s),)),)),
        total=Events((Counter(f"{histogram}_count"),)),
        histogram=histogram,
        event=event,
    )


def _le(threshold_s: float) -> str:
    """How Prometheus clients write a bucket boundary (1 -> "1.0", 0.5 -> "0.5")."""
    return repr(float(threshold_s))


def bucket_bounds(scrape: Scrape, histogram: str) -> tuple[float, ...]:
    """The finite bucket boundaries ``histogram`` has in one scrape, sorted (none: the server does not export it)."""
    bounds = set()
    for labels in scrape.get(f"{histogram}_bucket", {}):
        le = dict(labels).get("le")
        try:
            bound = float(le) if le is not None else None
        except ValueError:
            continue
        if bound is not None and bound != float("inf"):
            bounds.add(bound)
    return tuple(sorted(bounds))


FINISHED = Counter("vllm:request_success_total")
ERRORS = Counter("vllm:request_success_total", "finished_reason", ("error",))
# Refusals for load (admission control, an engine down or stalled, the cap on requests in progress or on one
# address's connections), not for bad input.
REJECTED = Counter(
    "kvstorm:rejected_requests_total",
    "reason",
    (
        "ttft_slo",
        "tpot_slo",
        "max_waiting",
        "max_queue_delay",
        "engine_unavailable",
        "connection_cap",
        "peer_connection_cap",
    ),
)
GUARDRAIL_WINDOW = "5m"
# How long a guardrail must be crossed before its alert fires.
GUARDRAIL_FOR_S = 120


def _spec(
    ttft_s: float, itl_s: float, e2e_s: float, preemptions_per_s: float, swap_out_blocks_per_s: float
) -> tuple[Slo, ...]:
    return (
        latency("ttft", "Time to first token", "vllm:time_to_first_token_seconds", ttft_s, 0.99, "a first token"),
        latency("itl", "Inter-token latency", "vllm:inter_token_latency_seconds", itl_s, 0.99, "a gap between tokens"),
        latency("e2e", "End-to-end latency", "vllm:e2e_request_latency_seconds", e2e_s, 0.99, "the whole request"),
        Slo(
            name="errors",
            title="Requests without an engine error",
            kind="events",
            threshold=0.001,
            objective=0.999,
            unit="percentunit",
            description="99.9% of finished requests end without an engine error (finish reason error)",
            good=Events((FINISHED,), minus=(ERRORS,)),
            total=Events((FINISHED,)),
        ),
        Slo(
            name="admitted",
            title="Requests admitted",
            kind="events",
            threshold=0.05,
            objective=0.95,
            unit="percentunit",
            description="95% of requests admitted rather than refused for load before they start (kvstorm's "
            "rejected requests: admission limits, an engine down or stalled, a connection cap; a server without that "
            "counter admits all)",
            good=Events((FINISHED,)),
            total=Events((FINISHED, REJECTED)),
        ),
        Slo(
            name="preemptions",
            title="Preemption rate",
            kind="guardrail",
            threshold=preemptions_per_s,
            unit="ops",
            description=f"at most {preemptions_per_s:g} preemptions per second over 5 minutes",
            rate_of=Counter("vllm:num_preemptions_total"),
        ),
        Slo(
            name="swap_out",
            title="Swap-out rate",
            kind="guardrail",
            threshold=swap_out_blocks_per_s,
            unit="ops",
            description=f"at most {swap_out_blocks_per_s:g} KV blocks swapped out per second over 5 minutes",
            rate_of=Counter("kvstorm:swap_blocks_total", "direction", ("out",)),
        ),
        Slo(
            name="kv_usage",
            title="KV cache usage",
            kind="guardrail",
            threshold=0.98,
            unit="percentunit",
            description="the KV cache under 98% used, so running requests can grow without preemption",
            gauge="vllm:kv_cache_usage_perc",
        ),
    )


PROFILES: dict[str, tuple[Slo, ...]] = {
    # The bundled SmolLM2-135M on 2 CPU cores: a decode step takes 50-150 ms, a burst queues for seconds.
    # A step that prefills a 2048-token chunk takes about half a second there, so a gap of 1 s is the bound.
    "cpu": _spec(ttft_s=5.0, itl_s=1.0, e2e_s=30.0, preemptions_per_s=1.0, swap_out_blocks_per_s=20.0),
    # An 8B model on one H200: steps of 10-30 ms.
    "h200": _spec(ttft_s=0.5, itl_s=0.05, e2e_s=10.0, preemptions_per_s=5.0, swap_out_blocks_per_s=200.0),
}


def load_spec(profile: str = "cpu", overrides: Path | Mapping[str, Any] | None = None) -> tuple[Slo, ...]:
    """A profile's SLOs with a user's overrides: ``{slo name: {threshold: ..., objective: ...}}`` (a YAML file or a
    mapping). A latency threshold changes the SLI's bucket too. ``ValueError`` names an unknown profile, SLO or
    field."""
    if profile not in PROFILES:
        raise ValueError(f"unknown SLO profile {profile!r}; profiles: {', '.join(PROFILES)}")
    if isinstance(overrides, Path):
        overrides = yaml.safe_load(overrides.read_text()) or {}
    slos = {slo.name: slo for slo in PROFILES[profile]}
    for name, changes in (overrides or {}).items():
        if name not in slos:
            raise ValueError(f"unknown SLO {name!r}; SLOs: {', '.join(slos)}")
        unknown = set(changes) - {"threshold", "objective"}
        if unknown:
            raise ValueError(f"SLO {name}: only threshold and objective can be overridden, not {sorted(unknown)}")
        slo = slos[name]
        values = {"threshold": slo.threshold, "objective": slo.objective, **changes}
        if slo.histogram is not None:
            slos[name] = latency(
                slo.name, slo.title, slo.histogram, values["threshold"], values["objective"], slo.event
            )
        else:
            slos[name] = replace(slo, **changes)
    return tuple(slos.values())
