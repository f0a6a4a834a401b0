"""Boards (``dashboards.panels``) as Grafana dashboards, built with grafanalib: a datasource, model and instance
variable on each, panels two to a row on a 24-column grid, units, legends and thresholds set, and the fault windows
of the chaos controller as annotations."""

from __future__ import annotations

import json

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    Annotations,
    Dashboard,
    GridPos,
    Heatmap,
    RowPanel,
    Stat,
    StateTimeline,
    Target,
    Template,
    Templating,
    Threshold,
    Time,
    TimeSeries,
    YAxis,
)

from dashboards.panels import Board, Panel

DATASOURCE = "${datasource}"
PANEL_WIDTH, PANEL_HEIGHT, ROW_HEIGHT = 12, 8, 1
FAULT_ANNOTATION = {
    "name": "Fault windows",
    "datasource": DATASOURCE,
    "enable": True,
    "iconColor": "rgba(214, 39, 40, 0.6)",
    "expr": "max by (fault) (kvstorm_chaos_fault_active) == 1",
    "step": "5s",
    "titleFormat": "{{fault}}",
    "useValueForTime": False,
}


def build(board: Board) -> Dashboard:
    panels, y = [], 0
    for row_title, row_panels in board.rows:
        panels.append(RowPanel(title=row_title, gridPos=GridPos(h=ROW_HEIGHT, w=24, x=0, y=y)))
        y += ROW_HEIGHT
        for index, panel in enumerate(row_panels):
            x = (index % 2) * PANEL_WIDTH
            panels.append(_panel(panel, GridPos(h=PANEL_HEIGHT, w=PANEL_WIDTH, x=x, y=y)))
            if index % 2 == 1 or index == len(row_panels) - 1:
                y += PANEL_HEIGHT
    return Dashboard(
        title=board.title,
        uid=board.uid,
        description=board.description,
        tags=["kvstorm"],
        panels=panels,
        templating=Templating(list=_variables()),
        annotations=Annotations(list=[FAULT_ANNOTATION]),
        time=Time("now-30m", "now"),
        refresh="5s",
        timezone="browser",
        schemaVersion=37,
    ).auto_panel_ids()


def to_json(board: Board) -> str:
    return json.dumps(build(board).to_json_data(), cls=DashboardEncoder, indent=1, sort_keys=True)


def _variables() -> list[Template]:
    return [
        Template(name="datasource", label="Prometheus", query="prometheus", type="datasource"),
        _label_variable("model", "label_values(vllm:num_requests_running, model_name)"),
        _label_variable("instance", 'label_values(vllm:num_requests_running{model_name=~"$model"}, instance)'),
    ]


def _label_variable(name: str, query: str) -> Template:
    """A variable over a label's values, all of them by default."""
    return Template(
        name=name,
        label=name,
        query=query,
        dataSource=DATASOURCE,
        includeAll=True,
        multi=True,
        allValue=".*",
        default="$__all",
    )


def _panel(panel: Panel, position: GridPos):
    targets = [
        Target(expr=query.expr, legendFormat=query.legend, refId=chr(ord("A") + index), datasource=DATASOURCE)
        for index, query in enumerate(panel.queries)
    ]
    common = {"title": panel.title, "dataSource": DATASOURCE, "targets": targets, "gridPos": position}
    if panel.description:
        common["description"] = panel.description
    steps = [Threshold(color, index, value=0.0 if value is None else float(value)) for index, (value, color) in
             enumerate(panel.thresholds)]  # fmt: skip
    if panel.kind == "stat":
        return Stat(**common, format=panel.unit or "none", thresholds=steps, reduceCalc="lastNotNull", graphMode="area")
    if panel.kind == "heatmap":
        return Heatmap(**common, dataFormat="tsbuckets", hideZeroBuckets=True, yAxis=YAxis(format=panel.unit))
    if panel.kind == "state":
        return StateTimeline(**common, thresholds=[Threshold("transparent", 0, 0.0), Threshold("red", 1, 1.0)])
    overrides = [
        {
            "matcher": {"id": "byName", "options": legend},
            "properties": [
                {"id": "custom.axisPlacement", "value": "right"},
                {"id": "unit", "value": panel.right_unit},
            ],
        }
        for legend in panel.right_axis
    ]
    return TimeSeries(
        **common,
        unit=panel.unit,
        thresholds=steps,
        thresholdsStyleMode="line" if steps else "off",
        overrides=overrides,
        legendDisplayMode="table",
        legendCalcs=["lastNotNull", "max"],
        tooltipMode="multi",
    )
