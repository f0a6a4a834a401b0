"""The dashboards without Grafana: every panel's queries evaluated over Prometheus' HTTP API (``query_range``) and
drawn with plotly into one self-contained HTML file, two panels to a row as in Grafana (``kvstorm dashboards
render``). Stats show their last value coloured by their thresholds; heatmaps and state timelines are heatmaps."""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
import requests
from plotly.subplots import make_subplots

from dashboards.panels import Board, Panel, concrete, source_series

MAX_POINTS = 400
NOT_EXPORTED = "not exported by the scraped servers"


@dataclass(frozen=True)
class Series:
    legend: str
    times: list[float]
    values: list[float]


def query_range(prometheus_url: str, expr: str, start_unix: float, end_unix: float, step_s: float) -> list[dict]:
    """The result of one range query (``ValueError`` with Prometheus' error when it refuses the query)."""
    params = {"query": concrete(expr), "start": start_unix, "end": end_unix, "step": step_s}
    response = requests.get(f"{prometheus_url.rstrip('/')}/api/v1/query_range", params=params, timeout=60)
    payload = response.json()
    if payload.get("status") != "success":
        raise ValueError(f"Prometheus refused {concrete(expr)!r}: {payload.get('error')}")
    return payload["data"]["result"]


def panel_series(prometheus_url: str, panel: Panel, start_unix: float, end_unix: float) -> list[Series]:
    step_s = max(1.0, (end_unix - start_unix) / MAX_POINTS)
    series = []
    for query in panel.queries:
        for result in query_range(prometheus_url, query.expr, start_unix, end_unix, step_s):
            legend = _legend(query.legend, result["metric"]) or query.expr
            points = [(float(t), float(v)) for t, v in result["values"]]
            series.append(Series(legend, [t - end_unix for t, _ in points], [v for _, v in points]))
    return series


def exported_series(prometheus_url: str, start_unix: float, end_unix: float) -> set[str]:
    """The names of every series Prometheus holds samples of in ``[start_unix, end_unix]``, and of every series a
    scraped server declares (its HELP and TYPE) without a sample yet: a labelled counter such as preemptions by mode
    has none until the first preemption, yet the server exports it."""
    stored = _prometheus_data(prometheus_url, "label/__name__/values", {"start": start_unix, "end": end_unix})
    declared = set()
    for name, entries in _prometheus_data(prometheus_url, "metadata", {}).items():
        kinds = {entry.get("type") for entry in entries}
        suffixes = ("_bucket", "_sum", "_count") if kinds & {"histogram", "summary"} else ("",)
        declared.update(name + suffix for suffix in suffixes)
    return set(stored) | declared


def _prometheus_data(prometheus_url: str, path: str, params: dict) -> dict | list:
    response = requests.get(f"{prometheus_url.rstrip('/')}/api/v1/{path}", params=params, timeout=60)
    payload = response.json()
    if payload.get("status") != "success":
        raise ValueError(f"Prometheus did not answer /api/v1/{path}: {payload.get('error')}")
    return payload["data"]


def render(
    boards: Sequence[Board],
    prometheus_url: str,
    start_unix: float,
    end_unix: float,
    recordings: Mapping[str, str],
) -> str:
    """One HTML page: every board's panels with the data of ``[start_unix, end_unix]``. A panel that reads a series
    no scraped server exports (a kvstorm series on vLLM) names it (``recordings``: the recording rules, name ->
    expression, so that a rule's panel names the series it is computed from)."""
    sections, first = [], True
    exported = exported_series(prometheus_url, start_unix, end_unix)
    for board in boards:
        figures = []
        for row_title, panels in board.rows:
            figures.append(f"<h3 class='row'>{html.escape(row_title)}</h3>")
            for panel in panels:
                read = set().union(*(source_series(concrete(q.expr), recordings) for q in panel.queries))
                series = panel_series(prometheus_url, panel, start_unix, end_unix)
                figure = _figure(panel, series, sorted(read - exported))
                figures.append(f"<div class='panel'>{figure.to_html(full_html=False, include_plotlyjs=first)}</div>")
                first = False
        sections.append(
            f"<h2>{html.escape(board.title)}</h2><p>{html.escape(board.description)}</p>"
            f"<div class='grid'>{''.join(figures)}</div>"
        )
    seconds = end_unix - start_unix
    window = f"the last {seconds:.0f} s" if seconds < 120 else f"the last {seconds / 60:.0f} minutes"
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvstorm dashboards</title>"
        f"<style>{_CSS}</style></head><body><h1>kvstorm dashboards</h1>"
        f"<p>Prometheus {html.escape(prometheus_url)}, {window} (x axis: seconds before the end).</p>"
        f"{''.join(sections)}</body></html>"
    )


def _figure(panel: Panel, series: list[Series], not_exported: list[str]) -> go.Figure:
    """``not_exported``: series the panel reads that no scraped server exports."""
    named = f"{NOT_EXPORTED}: {', '.join(not_exported)}"
    title = panel.title if not series or not not_exported else f"{panel.title}<br><sup>{named}</sup>"
    layout = {"title": title, "height": 300, "margin": {"l": 50, "r": 20, "t": 50, "b": 30}}
    if not series:
        figure = go.Figure()
        # One series a line: a panel is half a page wide.
        text = "<br>".join([f"no data: {NOT_EXPORTED}:", *not_exported]) if not_exported else "no data in this window"
        figure.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
        return figure.update_layout(**layout)
    if panel.kind == "stat":
        return _stat(panel, series).update_layout(**layout)
    if panel.kind in ("heatmap", "state"):
        rows = sorted(series, key=lambda s: _bucket_order(s.legend)) if panel.kind == "heatmap" else series
        # Series start and end at different times: one grid of every time any of them has.
        times = sorted({t for s in rows for t in s.times})
        z = [[dict(zip(s.times, s.values, strict=True)).get(t) for t in times] for s in rows]
        figure = go.Figure(go.Heatmap(x=times, y=[s.legend for s in rows], z=z, colorscale="Reds", zmin=0))
        return figure.update_layout(**layout)
    figure = make_subplots(specs=[[{"secondary_y": bool(panel.right_axis)}]])
    for s in series:
        figure.add_trace(
            go.Scatter(x=s.times, y=s.values, name=s.legend, mode="lines"), secondary_y=s.legend in panel.right_axis
        )
    for value, color in panel.thresholds:
        if value is not None:
            figure.add_hline(y=value, line_dash="dot", line_color=color)
    figure.update_yaxes(title_text=panel.unit, secondary_y=False)
    if panel.right_axis:
        figure.update_yaxes(title_text=panel.right_unit, secondary_y=True)
    return figure.update_layout(**layout)


def _stat(panel: Panel, series: list[Series]) -> go.Figure:
    figure = go.Figure()
    for index, s in enumerate(series):
        value = s.values[-1]
        color = next((c for threshold, c in reversed(panel.thresholds) if threshold is None or value >= threshold), "")
        number = {"valueformat": ".2%"} if panel.unit == "percentunit" else {"suffix": f" {panel.unit}"}
        figure.add_trace(
            go.Indicator(
                mode="number",
                value=value,
                title={"text": s.legend},
                number={**number, "font": {"color": color or None}},
                domain={"row": 0, "column": index},
            )
        )
    return figure.update_layout(grid={"rows": 1, "columns": len(series)})


def _legend(template: str, labels: dict[str, str]) -> str:
    """A Grafana legend format (``{{label}}``) filled with a series' labels."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda match: labels.get(match[1], ""), template)


def _bucket_order(legend: str) -> float:
    try:
        return float(legend)
    except ValueError:
        return float("inf")


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 0.5em; }
.row { grid-column: 1 / span 2; margin: 0.8em 0 0 0; border-bottom: 1px solid #ccc; }
"""
