"""Dashboards as plain data: boards of rows of panels of PromQL queries. Grafana's JSON (``dashboards.grafana``)
and the Grafana-less HTML view (``dashboards.render``) are both drawn from these, so they show the same queries.

Queries may use Grafana's template variables ``$model`` and ``$instance`` (in ``SEL``) and ``$__rate_interval``;
``concrete`` replaces them for a tool that is not Grafana (Prometheus' own API, promtool).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

SEL = 'model_name=~"$model", instance=~"$instance"'
RATE = "$__rate_interval"
CONCRETE = {"$model": ".*", "$instance": ".*", RATE: "1m"}
# Every series name the boards and rules read: the engine's (vLLM's names and kvstorm's), the controller's, and the
# recording rules' (``model_name:...``).
METRIC_NAME = re.compile(r"\b((?:vllm|kvstorm|model_name):[a-z0-9_:]+|kvstorm_chaos_[a-z0-9_]+)")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # timeseries, stat, heatmap (queries: bucket rates by le) or state (0/1 series)
    unit: str = ""  # Grafana's unit: s, percentunit, ops, short, bytes...
    description: str = ""
    # Colour steps of a stat (and a time series' threshold line): (from value, colour); the first from None.
    thresholds: tuple[tuple[float | None, str], ...] = ()
    # Legends of the queries drawn against a second axis on the right (an overlay of two units).
    right_axis: tuple[str, ...] = ()
    right_unit: str = ""


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]

    @property
    def panels(self) -> list[Panel]:
        return [panel for _, panels in self.rows for panel in panels]


def source_series(expr: str, recordings: Mapping[str, str]) -> set[str]:
    """The series a query reads from the servers: a recording rule's name (``recordings``: name -> expression)
    stands for the series its expression reads."""
    names = set()
    for name in METRIC_NAME.findall(expr):
        names |= source_series(recordings[name], recordings) if name in recordings else {name}
    return names


def concrete(expr: str) -> str:
    for variable, value in CONCRETE.items():
        expr = expr.replace(variable, value)
    return expr


def quantile_query(histogram: str, q: float, legend_prefix: str = "") -> Query:
    """The ``q`` quantile of a histogram over the rate interval, its legend ``p50``, ``p99``... after the prefix."""
    expr = f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{SEL}}}[{RATE}])))"
    return Query(expr, f"{legend_prefix}p{round(q * 100)}")


def quantiles(histogram: str, title: str, description: str = "") -> Panel:
    """p50, p90 and p99 of a histogram."""
    return Panel(
        title, tuple(quantile_query(histogram, q) for q in (0.5, 0.9, 0.99)), unit="s", description=description
    )


def heatmap(histogram: str, title: str) -> Panel:
    return Panel(
        title,
        (Query(f"sum by (le) (rate({histogram}_bucket{{{SEL}}}[{RATE}]))", "{{le}}"),),
        kind="heatmap",
        unit="s",
        description="Requests per second in each bucket of the histogram, over time",
    )


def rate_by(metric: str, by: str, title: str, unit: str = "ops", selector: str = "", description: str = "") -> Panel:
    labels = f"{SEL}, {selector}" if selector else SEL
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return Panel(
        title,
        (Query(f"sum by ({by}) (rate({metric}{{{labels}}}[{RATE}]))", legend),),
        unit=unit,
        description=description,
    )
