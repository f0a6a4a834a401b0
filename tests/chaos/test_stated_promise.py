"""A promise the server states is a promise the verdict checks: kvstorm serve states its TTFT objective on /metrics
(``--ttft-slo``, at the 95th percentile admission judges by), and every library experiment with a main load checks
that the load's admitted requests kept it (``chaos.probes.stated_promise_kept``). A server that states none gets
"no promise stated"."""

from __future__ import annotations

import http.server
import os
import re
import secrets
import subprocess
import sys
import threading

import pytest
import requests

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from chaos.injectors.processes import kvstorm_server
from chaos.probes import STATED_TTFT_OBJECTIVE, stated_promise_kept
from tests.dashboards.test_vllm_metrics import metrics_handler
from tests.engine.serving.conftest import metric_value

# A freeze admission cannot foresee: requests admitted just before it and during it wait up to 6 s for a first
# token, three times the 2 s the server states.
FROZEN = {
    "rate_unit": "req/s",
    "arrival": "poisson:rate=1",
    "duration_s": 16,
    "freeze_after_s": 3,
    "freeze_s": 6,
    "baseline_requests": 2,
}


def test_admitted_requests_that_miss_the_stated_objective_make_the_run_deviate(tmp_path):
    token = secrets.token_urlsafe(16)
    env = {**os.environ, ADMIN_TOKEN_ENV: token}
    server_args = ("--dtype", "float32", "--num-kv-blocks", "88", "--ttft-slo", "2s")
    with kvstorm_server(server_args, tmp_path / "server.log", env=env) as server:
        page = requests.get(f"{server.url}/metrics", timeout=10).text
        assert metric_value(page, STATED_TTFT_OBJECTIVE, quantile="0.95") == 2.0
        variables = [f"--var={key}={value}" for key, value in FROZEN.items()]
        run = subprocess.run(
            [sys.executable, "-m", "kvstorm", "chaos", "run", "frozen-engine", "--target", server.url,
             "--results-dir", str(tmp_path / "results"), *variables],
            capture_output=True, text=True, timeout=600, check=False, env=env,
        )  # fmt: skip
    assert run.returncode == 1, run.stderr[-3000:]
    (run_dir,) = (tmp_path / "results").glob("frozen-engine-*")
    verdict = (run_dir / "verdict.md").read_text()
    assert "DEVIATED" in verdict
    row = re.search(r"\| stated-ttft-promise-kept \| kept or no promise stated \| (.*?) \| (.*?) \|", verdict)
    assert row, verdict
    before, after = row.groups()
    assert before.startswith("kept: admitted TTFT p95"), verdict
    waited = re.match(r"missed: admitted TTFT p95 ([\d.]+) s against the stated 2 s", after)
    assert waited, verdict
    assert float(waited[1]) > 2


def test_a_server_that_states_no_objective_gets_no_promise_stated(kvstorm_server):
    """The session's server runs with --ttft-slo off: it states nothing, and the probe says so without a load."""
    page = requests.get(f"{kvstorm_server.url}/metrics", timeout=10).text
    assert not [line for line in page.splitlines() if line.startswith(STATED_TTFT_OBJECTIVE + "{")]

    assert stated_promise_kept(kvstorm_server.url) == "no promise stated"


@pytest.mark.parametrize(
    "sample", ['{quantile="2"} 10', '{quantile="p95"} 10', '{quantile="0.95"} -1', '{quantile="0.95"} +Inf']
)
def test_a_promise_that_cannot_be_read_fails_the_check_instead_of_the_run(sample):
    """What a server states is input: a quantile outside (0, 1] or an objective that is not a positive number is
    named, and misses the check's tolerance, before any load is read."""
    page = f"# TYPE {STATED_TTFT_OBJECTIVE} gauge\n{STATED_TTFT_OBJECTIVE}{sample}\n"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), metrics_handler(page))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        said = stated_promise_kept(f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert said.startswith("unreadable promise: "), said
    assert not re.search("^(kept|no promise stated)", said)
