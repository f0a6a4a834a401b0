"""A self-contained HTML report of one run (plotly, with its JavaScript inlined: one file that opens offline).

One figure shares the run's time axis (seconds since the start): arrival rate, outcomes, latency percentiles and,
when a Prometheus URL was given, the server's KV usage, running / waiting / swapped requests and preemption rate;
fault windows are shaded bands across all of it. A second figure holds the latency CDFs; a multi-turn run's third,
TTFT and cached prompt tokens by turn. A stacked report puts
several runs' timelines one above the other on one time axis (``kvstorm chaos compare``).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from loadgen.analysis import (
    LATE_TTFT_ROW,
    TURN_COLUMNS,
    LatencyStats,
    TimeSeries,
    TurnStats,
    describe_rates,
    time_series,
)
from loadgen.records import Outcome
from loadgen.results import RunResult

OUTCOME_COLORS = {
    Outcome.OK: "#2ca02c",
    Outcome.REJECTED: "#ff7f0e",
    Outcome.BROKEN_STREAM: "#d62728",
    Outcome.CLIENT_TIMEOUT: "#9467bd",
}
PERCENTILE_DASH = {"p50": "solid", "p90": "dash", "p99": "dot"}
LATENCY_ROWS = (("ttft", "TTFT ms"), ("tpot", "TPOT ms"), ("itl", "ITL ms"), ("e2e", "E2E ms"))
SERVER_ROWS = (("KV cache usage", "prefix cache hit rate"), ("running", "waiting", "swapped"), ("preemptions/s",))
# The rows of each run in a stacked report, and the server series a row needs (none: the load's own).
STACKED_ROWS = (
    ("outcomes per bucket", ()),
    ("TTFT / ITL ms", ()),
    ("KV cache usage / prefix cache hit rate", ("KV cache usage", "prefix cache hit rate")),
    ("running / waiting / swapped", ("running", "waiting", "swapped")),
    ("preemptions/s", ("preemptions/s",)),
)
# One colour per series in every run's rows of a stacked report, so the runs read alike.
STACKED_COLORS = {
    "ttft": "#1f77b4",
    "itl": "#ff7f0e",
    "KV cache usage": "#9467bd",
    "prefix cache hit rate": "#bcbd22",
    "running": "#2ca02c",
    "waiting": "#d62728",
    "swapped": "#8c564b",
    "preemptions/s": "#17becf",
}


def write_report(
    result: RunResult | None, path: Path, bucket_s: float = 1.0, *, title: str | None = None, heading_html: str = ""
) -> None:
    """``heading_html``: a section a caller puts above the run's own (a chaos run's verdict). ``result`` None: the
    heading alone, for a run whose load never ran (a chaos run stopped by its baseline)."""
    if result is None:
        parts = [heading_html, "<p>No load ran, so there is no timeline.</p>"]
    else:
        parts = [
            heading_html,
            _summary_html(result),
            _timeline(result, bucket_s).to_html(full_html=False, include_plotlyjs=True),
            _cdfs(result).to_html(full_html=False, include_plotlyjs=False),
        ]
        if result.summary.turns:
            parts.append(_by_turn(result.summary.turns).to_html(full_html=False, include_plotlyjs=False))
    title = title or ("kvstorm report" if result is None else f"kvstorm bench serve {result.run_id}")
    _write_page(path, title, parts)


def write_stacked_report(
    results: Sequence[tuple[str, RunResult | None]], path: Path, bucket_s: float = 1.0, *, title: str, heading_html: str
) -> None:
    """Several runs in one page (``kvstorm chaos compare``): ``heading_html`` on top, then each named run's timeline
    stacked over the others' on one time axis, seconds since each run's own load start (``stacked_timeline``)."""
    shown = [(name, result) for name, result in results if result is not None]
    parts = [heading_html]
    if shown:
        parts.append(stacked_timeline(shown, bucket_s).to_html(full_html=False, include_plotlyjs=True))
    missing = [name for name, result in results if result is None]
    if missing:
        parts.append(f"<p>No load ran for {html.escape(', '.join(missing))}, so there is no timeline of it.</p>")
    _write_page(path, title, parts)


def stacked_timeline(results: Sequence[tuple[str, RunResult]], bucket_s: float) -> go.Figure:
    """One figure, ``STACKED_ROWS`` rows per run (those its data fills), every row on the same x axis; each run's
    fault windows shade its own rows only."""
    rows = [(name, result, label) for name, result in results for label in _stacked_rows(result)]
    titles = [f"{name}: {label}" for name, _, label in rows]
    fig = make_subplots(
        rows=len(rows), cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.2 / len(rows)
    )
    for index, (name, result, label) in enumerate(rows, start=1):
        series = time_series(result.records, result.summary.duration_s, bucket_s)
        x = [start + bucket_s / 2 for start in series.start_s]
        for trace in _stacked_traces(label, name, result, series, x):
            trace.legendgroup = name  # the legend lists each run's traces together, in the runs' order
            fig.add_trace(trace, row=index, col=1)
        if label == "TTFT / ITL ms":  # a queued TTFT of seconds and a decode gap of milliseconds on one axis
            fig.update_yaxes(type="log", row=index, col=1)
        for window in result.fault_windows:
            x0, x1 = window.start_unix - result.start_unix, window.end_unix - result.start_unix
            fig.add_vrect(x0=x0, x1=x1, fillcolor="#d62728", opacity=0.15, line_width=0, row=index, col=1)
    height = 200 * len(rows) + 120
    fig.update_layout(
        barmode="stack",
        height=height,
        title="Over time (seconds since each run's load start)",
        legend={"traceorder": "grouped", "groupclick": "toggleitem"},
    )
    fig.update_xaxes(title_text="seconds since the load's start", row=len(rows), col=1)
    return fig


def _stacked_rows(result: RunResult) -> list[str]:
    names = {s.name for s in result.prometheus}
    return [label for label, needs in STACKED_ROWS if not needs or names & set(needs)]


def _stacked_traces(
    label: str, name: str, result: RunResult, series: TimeSeries, x: list[float]
) -> list[go.BaseTraceType]:
    """The traces of one row of ``stacked_timeline``; outcome colours and server series are the single report's."""
    if label == "outcomes per bucket":
        return [
            go.Bar(x=x, y=counts, name=f"{name}: {outcome.value}", marker_color=OUTCOME_COLORS[outcome])
            for outcome, counts in series.outcomes.items()
        ]
    if label == "TTFT / ITL ms":
        return [
            go.Scatter(
                x=x,
                y=[None if v is None else v * 1e3 for v in getattr(series, metric)[stat]],
                name=f"{name}: {metric} {stat}",
                line={"dash": PERCENTILE_DASH[stat], "color": STACKED_COLORS[metric]},
            )
            for metric in ("ttft", "itl")
            for stat in ("p50", "p99")
        ]
    needs = dict(STACKED_ROWS)[label]
    return [
        go.Scatter(
            x=[t - result.start_unix for t, _ in s.points],
            y=[v for _, v in s.points],
            name=f"{name}: {s.name}",
            line={"color": STACKED_COLORS[s.name]},
        )
        for s in result.prometheus
        if s.name in needs
    ]


def _write_page(path: Path, title: str, parts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>{''.join(parts)}</body></html>"
    )


def _timeline(result: RunResult, bucket_s: float) -> go.Figure:
    series = time_series(result.records, result.summary.duration_s, bucket_s)
    server_rows = [names for names in SERVER_ROWS if any(s.name in names for s in result.prometheus)]
    titles = ["arrival rate (requests/s)", "outcomes per bucket (by send time)"]
    titles += [label for _, label in LATENCY_ROWS] + [" / ".join(names) for names in server_rows]
    fig = make_subplots(rows=len(titles), cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.03)
    x = [start + bucket_s / 2 for start in series.start_s]
    fig.add_trace(go.Scatter(x=x, y=series.scheduled_rate, name="scheduled", line={"shape": "hv"}), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=series.sent_rate, name="sent", line={"shape": "hv"}), row=1, col=1)
    for outcome, counts in series.outcomes.items():
        fig.add_trace(
            go.Bar(x=x, y=counts, name=outcome.value, marker_color=OUTCOME_COLORS[outcome], legendgroup="outcomes"),
            row=2,
            col=1,
        )
    for row, (metric, _) in enumerate(LATENCY_ROWS, start=3):
        for name, values in getattr(series, metric).items():
            y = [None if v is None else v * 1e3 for v in values]
            line = {"dash": PERCENTILE_DASH[name]}
            fig.add_trace(go.Scatter(x=x, y=y, name=f"{metric} {name}", line=line, connectgaps=False), row=row, col=1)
    by_name = {s.name: s for s in result.prometheus}
    for row, names in enumerate(server_rows, start=3 + len(LATENCY_ROWS)):
        for name in names:
            if name in by_name:
                points = by_name[name].points
                fig.add_trace(
                    go.Scatter(x=[t - result.start_unix for t, _ in points], y=[v for _, v in points], name=name),
                    row=row,
                    col=1,
                )
    for window in result.fault_windows:
        x0, x1 = window.start_unix - result.start_unix, window.end_unix - result.start_unix
        fig.add_vrect(x0=x0, x1=x1, fillcolor="#d62728", opacity=0.15, line_width=0, row="all", col=1)
        # The band crosses every row; its name is written once, at the top.
        fig.add_annotation(x=x0, y=1, xref="x", yref="y domain", text=window.name, showarrow=False, xanchor="left")
    fig.update_layout(barmode="stack", height=240 * len(titles), title="Over time (seconds since the start)")
    fig.update_xaxes(title_text="seconds since the start", row=len(titles), col=1)
    return fig


def _cdfs(result: RunResult) -> go.Figure:
    ok = [r for r in result.records if r.outcome is Outcome.OK]
    values = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2e": [r.e2e_s for r in ok if r.e2e_s is not None],
    }
    fig = make_subplots(rows=1, cols=4, subplot_titles=[label for _, label in LATENCY_ROWS])
    for col, (metric, _) in enumerate(LATENCY_ROWS, start=1):
        data = np.sort(np.asarray(values[metric])) * 1e3
        if len(data) > 2000:  # a CDF needs no more points than the eye sees; keep the extremes
            data = data[np.unique(np.linspace(0, len(data) - 1, 2000).astype(int))]
        fraction = np.linspace(0, 1, len(data)) if len(data) > 1 else np.ones(len(data))
        fig.add_trace(go.Scatter(x=data, y=fraction, name=f"{metric} CDF", showlegend=False), row=1, col=col)
    fig.update_layout(height=360, title="Latency CDFs of ok requests (ms)")
    return fig


def _by_turn(turns: list[TurnStats]) -> go.Figure:
    """A multi-turn run by turn index: TTFT percentiles of the ok requests, and how much of their prompts (which
    grow with the conversation) the server said it served from its prefix cache."""
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=["TTFT by turn (ms)", "prompt tokens by turn: mean sent, mean cached"]
    )
    x = [turn.turn for turn in turns]
    for stat in ("p50", "p90", "p99"):
        y = [None if turn.ttft is None else turn.ttft.stat(stat) * 1e3 for turn in turns]
        dash = PERCENTILE_DASH.get(stat, "solid")
        fig.add_trace(go.Scatter(x=x, y=y, name=f"ttft {stat}", mode="lines+markers", line={"dash": dash}), 1, 1)
    fig.add_trace(go.Bar(x=x, y=[turn.mean_prompt_tokens for turn in turns], name="prompt tokens (mean)"), 1, 2)
    if any(turn.cached_tokens is not None for turn in turns):
        cached = [None if t.cached_tokens is None or not t.num_ok else t.cached_tokens / t.num_ok for t in turns]
        fig.add_trace(go.Bar(x=x, y=cached, name="cached tokens (mean, the server's usage)"), 1, 2)
    fig.update_xaxes(title_text="turn", dtick=1)
    fig.update_layout(height=380, barmode="overlay", title="By turn (ok requests)")
    return fig


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _summary_html(result: RunResult) -> str:
    summary, config = result.summary, result.config
    outcome_cells = "".join(f"<td>{html.escape(o.value)}: <b>{n}</b></td>" for o, n in summary.outcomes.items())
    latency_rows = ""
    for metric, label in (*LATENCY_ROWS, LATE_TTFT_ROW):
        stats: LatencyStats | None = getattr(summary, metric)
        cells = "".join(
            f"<td>{_ms(getattr(stats, s) if stats else None)}</td>" for s in ("mean", "p50", "p90", "p99", "max")
        )
        latency_rows += f"<tr><th>{label}</th>{cells}<td>{stats.count if stats else 0}</td></tr>"
    slo_rows = "".join(
        f"<tr class='{'met' if r.met else 'missed'}'><td>{r.slo.name}</td><td>{_ms(r.slo.threshold_s)}</td>"
        f"<td>{_ms(r.observed_s)}</td><td>{'met' if r.met else 'MISSED'}</td></tr>"
        for r in summary.slos
    )
    goodput = "" if summary.goodput is None else f"<li>goodput: <b>{summary.goodput:.2f}</b> requests/s</li>"
    rates = describe_rates(summary)
    goodput += f"<li>{html.escape(rates)}</li>" if rates else ""
    goodput += "".join(
        f"<li>{html.escape(part.describe())}</li>" for part in (summary.sessions, summary.prefix_reuse) if part
    )
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in result.advisories)
    config_rows = "".join(
        f"<tr><th>{html.escape(key)}</th><td>{html.escape(str(value))}</td></tr>"
        for key, value in config.model_dump().items()
    )
    return f"""
<table class='outcomes'><tr>{outcome_cells}</tr></table>
<ul><li>{summary.num_requests} requests in {summary.duration_s:.1f} s; peak {summary.peak_in_flight} in flight</li>
<li>throughput: <b>{summary.request_throughput:.2f}</b> ok requests/s,
<b>{summary.output_token_throughput:.1f}</b> output tokens/s</li>{goodput}</ul>
<h2>Latency of ok requests (ms)</h2>
<table><tr><th></th><th>mean</th><th>p50</th><th>p90</th><th>p99</th><th>max</th><th>count</th></tr>{latency_rows}</table>
<p>TPOT = (E2E - TTFT) / (output tokens - 1), as vLLM's benchmark defines it; ITL pools every gap between tokens.
Latencies count from each request's real send; the last row counts TTFT from its scheduled send, so a client that
fell behind its schedule shows there.</p>
{_turns_html(summary.turns or [])}
{_SLO_TABLE.format(rows=slo_rows) if slo_rows else ""}
{f"<h2>Read before trusting the numbers</h2><ul>{notes}</ul>" if notes else ""}
<h2>Configuration</h2><table>{config_rows}</table>
"""


def _turns_html(turns: list[TurnStats]) -> str:
    if not turns:
        return ""
    header = "".join(f"<th>{html.escape(column)}</th>" for column in TURN_COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in turn.cells()) + "</tr>" for turn in turns)
    return f"<h2>By turn (ok requests)</h2><table><tr>{header}</tr>{rows}</table>"


_SLO_TABLE = "<h2>SLOs</h2><table><tr><th>SLO</th><th>threshold ms</th><th>observed ms</th><th></th></tr>{rows}</table>"
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
tr.missed td { background: #fdd; } tr.met td { background: #dfd; }
li.missed { color: #a00; } li.met { color: #070; }
"""
