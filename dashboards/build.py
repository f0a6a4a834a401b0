"""``kvstorm dashboards build --out DIR``: every file the SLO spec turns into.

    DIR/prometheus/prometheus.yml        scrape config (the engine and the chaos controller) and the rule file
    DIR/prometheus/kvstorm-rules.yml     recording rules of every SLI, burn-rate and engine alerts
    DIR/prometheus/alerts-test*.yml      promtool unit tests of the alerts
                                         (promtool test rules alerts-test.yml alerts-test-3d.yml)
    DIR/grafana/dashboards/*.json        the Engine, SLO and Chaos dashboards
    DIR/grafana/provisioning/...         Grafana's datasource and dashboard provider

``dashboards/generated/`` holds this for the cpu profile and the compose stack's targets (a test keeps it equal to
what the code builds).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from dashboards.boards import chaos_board, engine_board, slo_board
from dashboards.grafana import to_json
from dashboards.panels import Board
from dashboards.rules import RULES_FILE, rule_groups, scrape_config, to_yaml
from dashboards.slo import Slo

PACKAGE_DIR = Path(__file__).resolve().parent
PROMTOOL_TESTS = sorted((PACKAGE_DIR / "promtool").glob("alerts-test*.yml"))
GENERATED_DIR = PACKAGE_DIR / "generated"
# Compose's engine: the file dashboards.scrape_target writes from the stack's target URL (compose.yaml mounts it).
COMPOSE_ENGINE_TARGETS = Path("/prometheus-targets/engine.json")
COMPOSE_CONTROLLER_TARGETS = ("chaos:8090",)
COMPOSE_PROMETHEUS_URL = "http://prometheus:9090"
GRAFANA_DASHBOARDS_PATH = "/var/lib/grafana/dashboards"


def boards(slos: Sequence[Slo]) -> list[Board]:
    return [engine_board(), slo_board(slos), chaos_board()]


def build_all(
    out: Path,
    slos: Sequence[Slo],
    engine_targets: Sequence[str] | Path = COMPOSE_ENGINE_TARGETS,
    controller_targets: Sequence[str] = COMPOSE_CONTROLLER_TARGETS,
    prometheus_url: str = COMPOSE_PROMETHEUS_URL,
    scrape_interval: str = "5s",
    rule_interval: str = "15s",
) -> list[Path]:
    """Write every file under ``out``; returns their paths."""
    files = {
        "prometheus/prometheus.yml": to_yaml(scrape_config(engine_targets, controller_targets, scrape_interval)),
        f"prometheus/{RULES_FILE}": to_yaml(rule_groups(slos, rule_interval)),
        "grafana/provisioning/datasources/prometheus.yml": to_yaml(_datasource(prometheus_url)),
        "grafana/provisioning/dashboards/kvstorm.yml": to_yaml(_dashboard_provider()),
        **{f"grafana/dashboards/{board.uid}.json": dashboard_json(board) + "\n" for board in boards(slos)},
    }
    written = []
    for relative, text in files.items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    tests = [out / "prometheus" / source.name for source in PROMTOOL_TESTS]
    for source, copy in zip(PROMTOOL_TESTS, tests, strict=True):
        shutil.copyfile(source, copy)
    return [*written, *tests]


# What grafanalib writes that Grafana's dashboard schema does not have: the pre-5.0 layout's fields, the old graph
# and heatmap panels', Graphite's in a query and the old graph's in a threshold step.
_LEGACY_FIELDS = {
    "dashboard": {"__inputs", "hideControls", "rows", "sharedCrosshair", "style"},
    "panel": {"editable", "error"},
    "heatmap": {"cards", "color", "dataFormat", "heatmap", "hideZeroBuckets", "highlightCards", "legend"}
    | {"reverseYBuckets", "tooltip", "xAxis", "yAxis"},
    "target": {"metric", "query", "step", "target"},
    "step": {"index", "line", "op", "yaxis"},
    "variable": {"useTags"},
    "current": {"tags"},
}
_ROW_FIELDS = {"type", "collapsed", "id", "panels", "title", "datasource", "gridPos", "repeat"}


def dashboard_json(board: Board) -> str:
    """A board's Grafana dashboard as Grafana's schema has it (tests/dashboards/test_grafana_schema.py checks it with
    grafana-foundation-sdk): grafanalib's JSON without its nulls and legacy fields, the heatmaps as the heatmap panel
    Grafana ships since 9.0 (its options, not the old panel's fields that Grafana would migrate on load)."""
    dashboard = _without_nulls(json.loads(to_json(board)))
    _drop(dashboard, "dashboard")
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            for key in set(panel) - _ROW_FIELDS:
                del panel[key]
            continue
        if panel["type"] == "heatmap":
            panel["options"] = _heatmap_options(panel)
            _drop(panel, "heatmap")
        _drop(panel, "panel")
        for target in panel.get("targets", []):
            _drop(target, "target")
        for step in panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", []):
            _drop(step, "step")
            if step.get("value") == "null":  # the base step, which has no lower bound
                del step["value"]
    for variable in dashboard["templating"]["list"]:
        _drop(variable, "variable")
        _drop(variable.get("current", {}), "current")
    return json.dumps(dashboard, indent=1, sort_keys=True)


def _heatmap_options(panel: dict) -> dict:
    """The heatmap panel's options for what grafanalib's old heatmap says: buckets already counted per series
    (``tsbuckets``), the unit of the y axis, empty buckets hidden."""
    options = {
        "calculate": panel.get("dataFormat") != "tsbuckets",
        "yAxis": {"unit": panel.get("yAxis", {}).get("format", "short"), "axisPlacement": "left"},
        "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5, "steps": 64},
        "cellGap": 1,
        "legend": {"show": False},
        "tooltip": {"mode": "single", "yHistogram": False},
    }
    if panel.get("hideZeroBuckets"):
        options["filterValues"] = {"le": 1e-9}
    return options


def _drop(fields: dict, kind: str) -> None:
    for key in _LEGACY_FIELDS[kind] & set(fields):
        del fields[key]


def _without_nulls(value: object) -> object:
    """Grafana's schema has no null for an optional field: it is left out."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _datasource(prometheus_url: str) -> dict:
    return {
        "apiVersion": 1,
        "datasources": [
            {"name": "Prometheus", "type": "prometheus", "access": "proxy", "url": prometheus_url, "isDefault": True}
        ],
    }


def _dashboard_provider() -> dict:
    return {
        "apiVersion": 1,
        "providers": [
            {
                "name": "kvstorm",
                "folder": "kvstorm",
                "type": "file",
                "disableDeletion": True,
                "options": {"path": GRAFANA_DASHBOARDS_PATH},
            }
        ],
    }
