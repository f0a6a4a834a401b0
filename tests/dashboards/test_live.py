"""The dashboards and rules against the real engine and a real Prometheus (Debian's), both on loopback.

The metric names the panels, rules and alerts use are ones the engine and the chaos controller expose; every
latency threshold is a bucket boundary of its histogram; then, with Prometheus scraping both every second, a short
chaos run through the controller (a burst under a KV cap: preemption and swap), one bad request and one failed step
give every panel something to show, and: every panel query and every SLI returns data, the preemptions Prometheus
recorded equal the engine's counter, the TTFT percentile computed by PromQL agrees with the load generator's own to
the histogram's resolution, the run's verdict judges the SLO spec on the same events as PromQL and its report links
the SLO and engine dashboards drawn over the run, and ``kvstorm dashboards render`` draws every panel.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import requests

from chaos.controller.metrics import ControllerMetrics
from chaos.injectors.processes import free_port
from chaos.run.metrics import MetricsSample
from dashboards.build import boards, build_all
from dashboards.panels import concrete, source_series
from dashboards.rules import recordings, rule_groups
from dashboards.slo import load_spec
from tests.chaos.test_controller import controller, events_until_end, start_run
from tests.dashboards.prometheus import running_prometheus

SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def families(exposition: str) -> set[str]:
    """Metric family names declared in a Prometheus exposition (a family with no sample yet still has # TYPE)."""
    return {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")}


def referenced_names() -> set[str]:
    slos = load_spec()
    exprs = [concrete(q.expr) for board in boards(slos) for panel in board.panels for q in panel.queries]
    exprs += [rule["expr"] for group in rule_groups(slos)["groups"] for rule in group["rules"]]
    return set().union(*(source_series(expr, recordings(slos)) for expr in exprs))


def family_of(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_every_metric_a_panel_rule_or_alert_reads_is_exposed(kvstorm_server):
    exposed = families(requests.get(f"{kvstorm_server.url}/metrics", timeout=30).text)
    exposed |= families(ControllerMetrics("http://127.0.0.1:9").exposition().decode())
    missing = sorted(name for name in referenced_names() if family_of(name) not in exposed and name not in exposed)
    assert missing == []


def test_every_latency_threshold_is_a_bucket_boundary_of_its_histogram(kvstorm_server):
    exposition = requests.get(f"{kvstorm_server.url}/metrics", timeout=30).text
    for profile in ("cpu", "h200"):
        for slo in load_spec(profile):
            if slo.histogram is None:
                continue
            bounds = {
                float(le) for le in re.findall(rf'^{re.escape(slo.histogram)}_bucket{{.*le="([^"]+)"', exposition, re.M)
            }
            assert slo.threshold in bounds, f"{profile} {slo.name}: {slo.threshold} is not a bucket of {slo.histogram}"


@pytest.fixture(scope="module")
def live(kvstorm_server, tmp_path_factory):
    """A controller and a Prometheus scraping it and the engine every second, and one finished chaos run."""
    tmp = tmp_path_factory.mktemp("live")
    port = free_port()
    prometheus_url = f"http://127.0.0.1:{port}"
    with controller(kvstorm_server, tmp, "--prometheus-url", prometheus_url) as (controller_url, _):
        out = tmp / "built"
        host = lambda url: url.removeprefix("http://")  # noqa: E731
        build_all(out, load_spec(), [host(kvstorm_server.url)], [host(controller_url)], "", "1s", "1s")
        with running_prometheus(out, tmp, port):
            run_id = start_run(controller_url).json()["id"]
            events_until_end(controller_url, run_id)
            bad = requests.post(
                f"{kvstorm_server.url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30
            )
            assert bad.status_code == 404
            kvstorm_server.admin.set_faults({"fail_next_steps": 1})
            ok = {"model": "smollm2-135m", "prompt": [1000, 1001, 1002], "max_tokens": 4}
            assert requests.post(f"{kvstorm_server.url}/v1/completions", json=ok, timeout=120).status_code == 200
            time.sleep(4)  # a few scrapes and rule evaluations after the last event
            (verdict,) = (tmp / "results" / run_id).glob("*/verdict.md")
            run_dir = verdict.parent
            yield prometheus_url, run_dir


# Panels of events the chaos run does not cause (the fixture's bad request and failed step come after it).
NOTHING_DURING_THE_RUN = {"Failed steps per second (the engine backs off)", "Refused before start, per second"}


def instant(prometheus_url: str, expr: str) -> list[dict]:
    payload = requests.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert payload["status"] == "success", payload
    return payload["data"]["result"]


def test_every_panel_query_and_every_sli_returns_data(live, kvstorm_server):
    from dashboards.render import panel_series

    prometheus_url, *_ = live
    end = time.time()
    empty = [
        f"{board.uid}: {panel.title}"
        for board in boards(load_spec())
        for panel in board.panels
        if not panel_series(prometheus_url, panel, end - 300, end)
    ]
    assert empty == []
    for group in rule_groups(load_spec())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                assert instant(prometheus_url, rule["record"]), f"{rule['record']} recorded nothing"


def test_the_preemptions_prometheus_saw_are_the_engines(live, kvstorm_server):
    prometheus_url, *_ = live
    engine = requests.get(f"{kvstorm_server.url}/metrics", timeout=30).text
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in engine.splitlines()
                  if line.startswith("vllm:num_preemptions_total"))  # fmt: skip
    assert counted > 0, "the run under a KV cap must preempt"
    (seen,) = instant(prometheus_url, "sum(vllm:num_preemptions_total)")
    assert float(seen["value"][1]) == counted
    (peak,) = instant(prometheus_url, "max_over_time(sum(rate(vllm:num_preemptions_total[5s]))[5m:1s])")
    assert float(peak["value"][1]) > 0, "the preemption panel shows them"


def test_ttft_p90_by_promql_agrees_with_the_clients_own_to_the_buckets(live, kvstorm_server):
    prometheus_url, run_dir = live
    load = json.loads((run_dir / "load.json").read_text())
    ttfts = [r["ttft_s"] for r in load["records"] if r["outcome"] == "ok"]
    client_p90 = float(np.percentile(ttfts, 90))
    window_s = round(load["summary"]["duration_s"]) + 2
    at = load["start_unix"] + window_s
    query = f"histogram_quantile(0.9, sum by (le) (increase(vllm:time_to_first_token_seconds_bucket[{window_s}s])))"
    payload = requests.get(f"{prometheus_url}/api/v1/query", params={"query": query, "time": at}, timeout=30).json()
    server_p90 = float(payload["data"]["result"][0]["value"][1])
    exposition = requests.get(f"{kvstorm_server.url}/metrics", timeout=30).text
    bounds = sorted(
        {float(b) for b in re.findall(r'^vllm:time_to_first_token_seconds_bucket{.*le="([^"+]+)"', exposition, re.M)}
    )
    # PromQL's interpolation lands on a bucket's upper bound with float error (0.5000000000000004 for 0.5).
    index = next(i for i, bound in enumerate(bounds) if bound >= server_p90 * (1 - 1e-9))
    low, high = bounds[max(0, index - 2)], bounds[min(len(bounds) - 1, index + 2)]
    # The server's quantile interpolates inside a bucket, and the client's TTFT adds the network and the HTTP
    # handling (tens of ms, a bucket at this scale): a bucket earlier, or two later.
    assert low <= client_p90 <= high, (client_p90, server_p90, low, high)


def test_the_chaos_verdict_and_prometheus_count_the_same_events_for_every_slo(live, kvstorm_server):
    prometheus_url, run_dir = live
    load = json.loads((run_dir / "load.json").read_text())
    verdict = (run_dir / "verdict.md").read_text()
    # The verdict judges the run's load by the spec from /metrics (chaos.judgement.slo_check): its TTFT SLO counted
    # every request that got a first token, and no fewer good ones than the client (whose TTFT adds the network).
    threshold = {slo.name: slo for slo in load_spec()}["ttft"].threshold
    good, total = map(int, re.search(r"\| Time to first token \|[^|]*\| [0-9.]+% \((\d+) of (\d+)\)", verdict).groups())
    ttfts = [r["ttft_s"] for r in load["records"] if r["ttft_s"] is not None]
    assert total == len(ttfts) > 0
    assert sum(ttft <= threshold for ttft in ttfts) <= good <= total
    # Both sides select the same series: each counter an SLO reads, summed by PromQL and by the verdict's code.
    scrape = MetricsSample.parse(requests.get(f"{kvstorm_server.url}/metrics", timeout=30).text, time.time())
    for slo in load_spec():
        counters = slo.good.counters() + slo.total.counters() if slo.kind == "events" else (slo.rate_of,)
        for counter in filter(None, counters):
            seen = instant(prometheus_url, f"sum({counter.selector()})")
            by_promql = float(seen[0]["value"][1]) if seen else 0.0
            assert by_promql == counter.count(scrape.values), (slo.name, counter.selector())


def test_the_chaos_report_links_the_slo_and_engine_dashboards_over_its_run(live):
    _, run_dir = live
    assert "href='dashboards.html'" in (run_dir / "report.html").read_text()
    page = (run_dir / "dashboards.html").read_text()
    for board in boards(load_spec()):
        assert (f"<h2>{html.escape(board.title)}</h2>" in page) == (board.uid != "kvstorm-chaos")
    # Every panel of both boards has data, but those of events the run does not cause.
    empty = {title for chunk in page.split("<div class='panel'>")[1:] if "no data" in chunk
             for title in re.findall(r'"title":\{"text":"([^"]+)"', chunk)}  # fmt: skip
    assert empty <= NOTHING_DURING_THE_RUN, empty


def test_render_draws_every_panel_from_prometheus(live, tmp_path):
    prometheus_url, *_ = live
    out = tmp_path / "dashboards.html"
    command = [sys.executable, "-m", "kvstorm", "dashboards", "render", "--prometheus-url", prometheus_url,
               "--since", "5m", "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    for board in boards(load_spec()):
        for panel in board.panels:
            assert json.dumps(panel.title) in page
    assert "no data" not in page
