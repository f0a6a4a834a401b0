"""The SLO spec and what it builds, without a server: Prometheus' own tools check the config, the rules and their
unit tests, every PromQL expression of every panel parses, the dashboards have unique ids on a grid without
overlaps, and the files committed for the compose stack are what the code builds."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards.build import GENERATED_DIR, boards, build_all
from dashboards.panels import concrete
from dashboards.slo import PROFILES, load_spec


def promtool(*args: str, cwd: Path) -> str:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: install Debian's prometheus package (apt-get install prometheus)"
    result = subprocess.run([tool, *args], capture_output=True, text=True, cwd=cwd, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module", params=sorted(PROFILES))
def built(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    build_all(out, load_spec(request.param))
    return out


def test_prometheus_checks_the_config_the_rules_and_their_unit_tests(built):
    prometheus = built / "prometheus"
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml", cwd=prometheus)
    assert "SUCCESS" in promtool("check", "rules", "kvstorm-rules.yml", cwd=prometheus)


def test_every_alert_fires_when_it_should_and_stays_silent_when_it_should_not():
    """The unit tests are written against the cpu profile's thresholds."""
    out = GENERATED_DIR / "prometheus"
    tests = sorted(path.name for path in out.glob("alerts-test*.yml"))
    assert tests == ["alerts-test-3d.yml", "alerts-test.yml"]
    report = promtool("test", "rules", *tests, cwd=out)
    assert report.count("SUCCESS") == 2, report


def test_every_panel_query_is_valid_promql(tmp_path):
    # promtool parses the expression of every recording rule: each panel query becomes one.
    rules = [
        {"record": f"panel:query_{index}:check", "expr": concrete(query.expr)}
        for index, query in enumerate(
            q for board in boards(load_spec()) for panel in board.panels for q in panel.queries
        )
    ]
    (tmp_path / "panels.yml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in promtool("check", "rules", "panels.yml", cwd=tmp_path)


def test_dashboards_have_unique_ids_units_legends_and_no_overlapping_panels(built):
    for path in sorted((built / "grafana" / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        panels = dashboard["panels"]
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), path.name
        cells = set()
        for panel in panels:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24
            area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
            assert not cells & area, f"{path.name}: {panel['title']} overlaps another panel"
            cells |= area
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == "${datasource}"
            assert all(target["legendFormat"] for target in panel["targets"]), panel["title"]
            if panel["type"] in ("timeseries", "stat"):
                assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        variables = [v["name"] for v in dashboard["templating"]["list"]]
        assert variables == ["datasource", "model", "instance"]
        assert dashboard["annotations"]["list"][0]["expr"].startswith("max by (fault) (kvstorm_chaos_fault_active)")


def test_the_committed_files_are_what_the_code_builds(tmp_path):
    build_all(tmp_path, load_spec("cpu"))
    built = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    committed = {p.relative_to(GENERATED_DIR): p.read_text() for p in GENERATED_DIR.rglob("*") if p.is_file()}
    assert committed.keys() == built.keys()
    stale = [str(path) for path in built if built[path] != committed[path]]
    assert not stale, f"run `kvstorm dashboards build --out dashboards/generated`: {stale} changed"


def test_a_users_overrides_change_thresholds_and_bad_ones_are_refused(tmp_path):
    overrides = tmp_path / "slo.yaml"
    overrides.write_text("ttft: {threshold: 2.0, objective: 0.995}\nkv_usage: {threshold: 0.9}\n")
    slos = {slo.name: slo for slo in load_spec("cpu", overrides)}
    assert (slos["ttft"].threshold, slos["ttft"].objective) == (2.0, 0.995)
    assert 'le="2.0"' in slos["ttft"].good.rate("5m")
    assert slos["kv_usage"].threshold == 0.9
    with pytest.raises(ValueError, match="unknown SLO 'tfft'"):
        load_spec("cpu", {"tfft": {"threshold": 1}})
    with pytest.raises(ValueError, match="only threshold and objective"):
        load_spec("cpu", {"ttft": {"window": "7d"}})
    with pytest.raises(ValueError, match="unknown SLO profile"):
        load_spec("a100")
