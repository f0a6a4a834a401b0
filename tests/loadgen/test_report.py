"""A whole run through the library entry point: JSON results that read back, and the self-contained HTML report with
fault bands and the server's Prometheus series (from a fake Prometheus that answers range queries)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest
from aiohttp import web

from loadgen.benchmark import run_benchmark, summary_markdown
from loadgen.records import Outcome
from loadgen.report import write_report
from loadgen.results import FaultWindow, RunConfig, RunResult, read_fault_windows
from tests.loadgen.conftest import child_env, scripted_server


async def fake_prometheus(queries: list[dict]) -> web.AppRunner:
    async def query_range(request: web.Request) -> web.Response:
        queries.append(dict(request.query))
        if "swapped" in request.query["query"]:
            return web.json_response({"status": "success", "data": {"resultType": "matrix", "result": []}})
        start, end = float(request.query["start"]), float(request.query["end"])
        values = [[start + i * 0.5, str(i % 3)] for i in range(int((end - start) / 0.5) + 1)]
        return web.json_response(
            {"status": "success", "data": {"resultType": "matrix", "result": [{"values": values}]}}
        )

    app = web.Application()
    app.router.add_get("/api/v1/query_range", query_range)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def config(base_url: str) -> RunConfig:
    return RunConfig(
        base_url=base_url,
        model="m",
        arrival="poisson:rate=60",
        workload="chat",
        input_len="fixed:32",
        output_len="uniform:4-12",
        num_requests=40,
        duration_s=None,
        max_concurrency=None,
        request_timeout_s=2.0,
        stall_timeout_s=1.0,
        exact_output=True,
        seed=0,
        slo="ttft_p99=1s,e2e_p50=300ms",
    )


async def run_with_prometheus(base_url: str, queries: list[dict]) -> RunResult:
    prometheus = await fake_prometheus(queries)
    try:
        prometheus_url = f"http://127.0.0.1:{prometheus.addresses[0][1]}"
        now = time.time()
        window = FaultWindow(name="kill -9 engine", start_unix=now + 0.2, end_unix=now + 0.5)
        return await run_benchmark(
            config(base_url), fault_windows=[window], prometheus_url=prometheus_url, show_progress=False
        )
    finally:
        await prometheus.cleanup()


def test_results_json_and_html_report(tmp_path):
    queries: list[dict] = []
    with scripted_server("--fault-plan", "mixed", "--ttft-ms", "50", "--gap-ms", "5") as server:
        result = asyncio.run(run_with_prometheus(server.base_url, queries))
    assert result.summary.outcomes[Outcome.REJECTED] == 4  # orders 9, 19, 29, 39
    assert result.summary.outcomes[Outcome.BROKEN_STREAM] == 4  # orders 7, 13, 21, 33
    assert [slo.met for slo in result.summary.slos] == [True, True]
    # Prometheus: every query over the run's wall-clock window; the empty one is a note, not an error.
    assert len(queries) == 6
    assert all(float(q["start"]) == round(result.start_unix, 3) for q in queries)
    assert [series.name for series in result.prometheus] == [
        "KV cache usage",
        "running",
        "waiting",
        "preemptions/s",
        "prefix cache hit rate",
    ]
    assert any("vllm:num_requests_swapped" in note and "no data" in note for note in result.advisories)

    json_path = tmp_path / "run.json"
    result.write(json_path)
    assert RunResult.read(json_path) == result

    html_path = tmp_path / "run.html"
    write_report(result, html_path, bucket_s=0.25)
    html = html_path.read_text()
    assert not re.search(r"<script[^>]+src=", html)  # self-contained: plotly.js is inlined
    assert "Plotly.newPlot" in html
    # plotly escapes "/" in its JSON
    for text in (
        "kill -9 engine",
        "KV cache usage",
        "prefix cache hit rate",
        "preemptions\\u002fs",
        "broken_stream",
        "TTFT ms",
        "e2e_p50",
    ):
        assert text in html, text
    markdown = summary_markdown(result)
    assert "broken_stream 4" in markdown
    assert "| TPOT |" in markdown


def test_cli_refuses_a_bad_slo_before_sending_anything():
    result = subprocess.run(
        [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--base-url", "http://127.0.0.1:9",
         "--model", "m", "--num-requests", "1", "--slo", "ttft=2s"],
        capture_output=True, text=True, timeout=120, env=child_env(), check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "METRIC_STAT=DURATION" in result.stderr


def test_fault_windows_file_of_a_chaos_timeline(tmp_path):
    path = tmp_path / "faults.json"
    path.write_text('[{"name": "kv cap 50%", "start_unix": 100.5, "end_unix": 130}]')
    assert read_fault_windows(path) == [FaultWindow(name="kv cap 50%", start_unix=100.5, end_unix=130.0)]
    path.write_text('[{"name": "no end", "start_unix": 1}]')
    with pytest.raises(ValueError, match="end_unix"):
        read_fault_windows(path)


def test_cli_fails_when_no_request_succeeds(tmp_path):
    with scripted_server("--fault-plan", "mixed") as server:
        result = subprocess.run(
            [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--base-url", server.base_url + "/nope",
             "--model", "m", "--num-requests", "3", "--arrival", "constant:rate=100", "--no-progress",
             "--results-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=120, env=child_env(), check=False,
        )  # fmt: skip
    assert result.returncode == 1
    assert "rejected 3" in result.stdout  # 404: every request rejected, and the run still written and summarized
    assert "failed: no request succeeded" in result.stderr
    assert len(list(tmp_path.glob("*.json"))) == 1
