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
COMPOSE_ENGINE_TARGETS = ("engine:8000",)
COMPOSE_CONTROLLER_TARGETS = ("chaos:8090",)
COMPOSE_PROMETHEUS_URL = "http://prometheus:9090"
GRAFANA_DASHBOARDS_PATH = "/var/lib/grafana/dashboards"


def boards(slos: Sequence[Slo]) -> list[Board]:
    return [engine_board(), slo_board(slos), chaos_board()]


def build_all(
    out: Path,
    slos: Sequence[Slo],
    engine_targets: Sequence[str] = COMPOSE_ENGINE_TARGETS,
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
        **{f"grafana/dashboards/{board.uid}.json": to_json(board) + "\n" for board in boards(slos)},
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
